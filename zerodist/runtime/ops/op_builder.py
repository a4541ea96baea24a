"""``deepspeed.ops.op_builder``: DeepSpeed's op builders. None of the kernels is compatible here: a test
or script that asks ``is_compatible()`` skips the op, as on a DeepSpeed install without it; ``load()``
says what zerodist does instead. ``async_io`` answers yes (NVMe offload is available)."""

from __future__ import annotations

from typing import Any


class OpBuilder:
    NAME = "op"
    INSTEAD = "zerodist has no compiled ops"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def is_compatible(self, verbose: bool = False) -> bool:
        return False

    def load(self, verbose: bool = True) -> Any:
        raise NotImplementedError(f"DeepSpeed's compiled op {self.NAME!r} is not available: `import deepspeed` "
                                  f"is served by zerodist, which has no compiled ops; {self.INSTEAD}")


class AsyncIOBuilder(OpBuilder):
    """Compatible in the sense scripts ask it (NVMe offload is available: zerodist writes its swap files
    with plain file I/O); there is no aio handle to load."""

    NAME = "async_io"
    INSTEAD = ("nvme offload writes its swap files with plain file I/O (zero_optimization.offload_optimizer "
               "device 'nvme', docs/offload.md)")

    def is_compatible(self, verbose: bool = False) -> bool:
        return True


class CPUAdamBuilder(OpBuilder):
    NAME = "cpu_adam"
    INSTEAD = "name a torch optimizer in the config (\"optimizer\": {\"type\": \"Adam\"}); it steps on the CPU"


class FusedAdamBuilder(OpBuilder):
    NAME = "fused_adam"
    INSTEAD = "name a torch optimizer in the config (\"optimizer\": {\"type\": \"Adam\"})"


class GDSBuilder(OpBuilder):
    NAME = "gds"
    INSTEAD = AsyncIOBuilder.INSTEAD


BUILDERS = [AsyncIOBuilder, CPUAdamBuilder, FusedAdamBuilder, GDSBuilder]
