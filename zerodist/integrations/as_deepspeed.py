"""``import deepspeed`` served by zerodist: the Hugging Face stack's DeepSpeed path, unchanged, on zerodist.

    zerodist run --as-deepspeed --nproc 2 -- llamafactory-cli train cfg.yaml
    zerodist run --as-deepspeed --exec -- accelerate launch --use_deepspeed ... train.py
    PYTHONPATH=$(python -m zerodist.integrations.as_deepspeed):$PYTHONPATH torchrun ... train.py

[Note: serving `import deepspeed`]
transformers (``TrainingArguments(deepspeed=...)``) and accelerate (``DeepSpeedPlugin``,
``accelerate launch --use_deepspeed``) know DeepSpeed by two things: an installed *distribution*
named ``deepspeed`` (``importlib.metadata``, version-gated: transformers needs >= 0.9.3), and the
module ``deepspeed`` they import (``deepspeed.initialize``, ``deepspeed.comm``, ``deepspeed.zero``,
``deepspeed.utils.logger``, ``deepspeed.runtime.lr_schedules``, ...). The switch serves both from
zerodist, so the tools that build those objects (LLaMA-Factory, axolotl, TRL, a plain ``Trainer``)
train on zerodist's engine without a changed line:

- a directory (``alias_directory()``, made on first use) holds a stub package ``deepspeed`` and a
  ``deepspeed-<version>.dist-info``; ``zerodist run --as-deepspeed`` puts it first on
  ``PYTHONPATH``, so every rank finds both before any installed DeepSpeed;
- the stub's import calls ``install()``: a finder placed first on ``sys.meta_path`` serves
  ``deepspeed`` and every ``deepspeed.X`` from zerodist (``deepspeed.comm`` *is* ``zerodist.comm``,
  the same module object, so state is shared) and a distribution finder answers
  ``importlib.metadata`` for ``deepspeed`` first, whatever else is installed;
- the version served is ``0.19.8+zerodist<version>``: DeepSpeed's API version zerodist follows
  (docs/deepspeed.md), with a local label that says who serves it;
- a DeepSpeed name zerodist does not provide is a ``ModuleNotFoundError`` / ``AttributeError``
  saying that zerodist serves ``deepspeed`` here and what to use instead: a run never falls back
  to an installed DeepSpeed, and rank 0 logs which engine trains (``install()``).

``install()`` may also be called from a script before transformers is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zerodist.integrations import accelerate_on_cpu, trl_zero3
from zerodist.utils import get_logger, log_rank0

logger = get_logger(__name__)

DEEPSPEED_API_VERSION = "0.19.8"
ENV_FLAG = "ZERODIST_AS_DEEPSPEED"

# DeepSpeed's module paths whose zerodist module is elsewhere, or that zerodist adds for them. Any other
# `deepspeed.A.B` is `zerodist.A.B` when `deepspeed.A` is served by a zerodist package.
DEEPSPEED_MODULES = {
    "deepspeed": "zerodist.integrations.deepspeed_top",
    "deepspeed.comm": "zerodist.comm",
    "deepspeed.zero": "zerodist.runtime.zero",
    "deepspeed.pipe": "zerodist.pipe",
    "deepspeed.moe": "zerodist.moe",
    "deepspeed.sequence": "zerodist.sequence",
    "deepspeed.accelerator": "zerodist.accelerator",
    "deepspeed.runtime": "zerodist.runtime",
    "deepspeed.checkpoint": "zerodist.checkpoint",
    "deepspeed.utils": "zerodist.runtime.deepspeed_utils",
    "deepspeed.utils.groups": "zerodist.runtime.groups",
    "deepspeed.utils.logging": "zerodist.runtime.deepspeed_utils",
    "deepspeed.utils.torch": "zerodist.runtime.torch_version",
    "deepspeed.checkpointing": "zerodist.runtime.activation_checkpointing.checkpointing",
    "deepspeed.sequence.fpdt_layer": "zerodist.runtime.fpdt_layer",  # refuses on use: FPDT is not implemented
    # AutoTP is not served (below), but its split rule is: Ulysses code asks it which heads a rank holds.
    "deepspeed.module_inject": "zerodist.runtime.module_inject",
    "deepspeed.module_inject.tp_shard": "zerodist.runtime.module_inject.tp_shard",
    # Only "is this compiled op available?" (no, for each); the kernels themselves are _NOT_PROVIDED below,
    # but the CPU optimizers accelerate swaps in when the optimizer is offloaded, served as torch's
    # (runtime/ops/cpu_optimizers.py).
    "deepspeed.ops": "zerodist.runtime.ops",
    "deepspeed.ops.aio": "zerodist.runtime.ops.aio",
    "deepspeed.ops.op_builder": "zerodist.runtime.ops.op_builder",
    "deepspeed.ops.adam": "zerodist.runtime.ops.adam",
    "deepspeed.ops.adagrad": "zerodist.runtime.ops.adagrad",
    "deepspeed.utils.zero_to_fp32": "zerodist.runtime.zero_to_fp32",
}

# What a missing DeepSpeed module would have been used for, and the zerodist way.
_NOT_PROVIDED = {
    "deepspeed.ops": "DeepSpeed's CUDA/CPU kernels (FusedAdam, DeepSpeedCPULion, ...; DeepSpeedCPUAdam and "
                     "DeepSpeedCPUAdagrad are served as torch's); zerodist steps torch optimizers "
                     "(an \"optimizer\" section of the config, or the Trainer's own)",
    "deepspeed.module_inject": "AutoTP injection; use the config's \"tensor_parallel\": {\"autotp_size\": t}",
    "deepspeed.inference": "inference engines, which zerodist does not have",
    "deepspeed.launcher": "DeepSpeed's launcher; launch with `zerodist run` or torchrun",
}


def served_version() -> str:
    import zerodist

    return f"{DEEPSPEED_API_VERSION}+zerodist{zerodist.__version__}"


def _target(fullname: str) -> str:
    """The zerodist module that serves DeepSpeed's `fullname` (`deepspeed.A.B` is `zerodist.A.B` below a
    served zerodist package), or raises naming what to use instead."""
    if fullname in DEEPSPEED_MODULES:
        return DEEPSPEED_MODULES[fullname]
    for prefix, why in _NOT_PROVIDED.items():
        if fullname == prefix or fullname.startswith(prefix + "."):
            raise _missing(fullname, why)
    parent, _, child = fullname.rpartition(".")
    if parent in ("", "deepspeed"):
        raise _missing(fullname, "")
    return f"{_target(parent)}.{child}"


def _missing(fullname: str, why: str) -> ModuleNotFoundError:
    reason = f": {why}" if why else "; docs/deepspeed.md lists DeepSpeed's names and what zerodist gives for each"
    error = ModuleNotFoundError(f"No module named {fullname!r}: `import deepspeed` is served by zerodist here "
                                f"(zerodist run --as-deepspeed / {ENV_FLAG}), which does not provide it{reason}")
    error.name = fullname
    return error


class _AliasLoader(importlib.abc.Loader):
    """Hands back the zerodist module itself: one module object under two names."""

    def __init__(self, target: types.ModuleType) -> None:
        self.target = target
        self.original_spec = target.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.target

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system has just written the alias spec on it; the module keeps its own name and spec.
        module.__spec__ = self.original_spec


class _ServedDistribution(importlib.metadata.Distribution):
    """The `deepspeed` distribution `importlib.metadata` sees: zerodist's, with DeepSpeed's API version."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return _metadata_text()
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(alias_directory()) / str(path)


def _metadata_text() -> str:
    return ("Metadata-Version: 2.1\nName: deepspeed\n"
            f"Version: {served_version()}\n"
            "Summary: DeepSpeed's API served by zerodist (zerodist run --as-deepspeed); not DeepSpeed\n")


class DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """First on `sys.meta_path`: `deepspeed` and `deepspeed.*` from zerodist, and the `deepspeed` distribution."""

    announced = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "accelerate.state":
            return accelerate_on_cpu.patched_spec(self, fullname, path, target)
        if fullname in trl_zero3.PATCHES:
            return trl_zero3.patched_spec(self, fullname, path, target)
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        if not self.announced:
            self.announced = True
            _announce()
        target = _target(fullname)
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as error:
            if error.name != target:
                raise
            raise _missing(fullname, "") from None
        is_package = hasattr(module, "__path__")
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(module), is_package=is_package)
        if is_package:
            spec.submodule_search_locations = []
        return spec

    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()
                           ) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("-", "_").lower() == "deepspeed":
            yield _ServedDistribution()


_FINDER = DeepSpeedFinder()


def install() -> None:
    """Serve `import deepspeed` and its distribution from zerodist in this process (idempotent);
    rank 0 logs it once, naming a real DeepSpeed install that is thereby not used."""
    if _FINDER in sys.meta_path:
        return
    for name in [name for name in sys.modules if name == "deepspeed" or name.startswith("deepspeed.")]:
        module = sys.modules[name]
        if not (getattr(module, "__name__", "").startswith("zerodist") or _is_stub(module)):
            raise RuntimeError(f"DeepSpeed ({getattr(module, '__file__', name)}) was imported before zerodist could "
                               "serve `import deepspeed`; start the process with `zerodist run --as-deepspeed`, or call "
                               "zerodist.integrations.as_deepspeed.install() before anything imports deepspeed")
        del sys.modules[name]
    sys.meta_path.insert(0, _FINDER)
    # imported before the switch: its later users still get the answer, but a TRL module that already did
    # `from trl.trainer.utils import maybe_gather_lm_head_ctx` keeps TRL's own, which reads `param.ds_status`
    # under ZeRO-3: serve deepspeed before TRL is imported (`zerodist run --as-deepspeed` does)
    for name, complete in trl_zero3.PATCHES.items():
        if name in sys.modules:
            complete(sys.modules[name])
    os.environ[ENV_FLAG] = "1"


def _announce() -> None:
    """Rank 0 says once which engine trains (on the process's first `import deepspeed`)."""
    shadowed = _installed_deepspeed()
    note = f"; the DeepSpeed {shadowed} installed here is not used" if shadowed else ""
    log_rank0(logger, "zerodist trains: `import deepspeed` is served by zerodist (DeepSpeed API %s)%s",
              served_version(), note)


def _is_stub(module: types.ModuleType) -> bool:
    return getattr(module, "__file__", None) == str(Path(alias_directory()) / "deepspeed" / "__init__.py")


def _installed_deepspeed() -> str | None:
    """The version of a real DeepSpeed distribution on the path (not ours), if any."""
    for dist in importlib.metadata.distributions(name="deepspeed"):
        version = dist.version
        if "+zerodist" not in version:
            return version
    return None


_SITECUSTOMIZE = '''"""zerodist run --as-deepspeed: serve `import deepspeed` from zerodist in this process
(zerodist.integrations.as_deepspeed), then run the sitecustomize this one shadows, if any."""
import os
import sys

if os.environ.get("ZERODIST_AS_DEEPSPEED") == "1":
    try:
        from zerodist.integrations import as_deepspeed
    except ImportError:  # an interpreter without zerodist (a tool's own subprocess)
        pass
    else:
        as_deepspeed.install()


def _chain():
    import runpy
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry or os.getcwd(), "sitecustomize.py")
        if os.path.abspath(entry or os.getcwd()) != here and os.path.isfile(candidate):
            runpy.run_path(candidate, run_name="sitecustomize")
            return


_chain()
'''

_STUB = '''"""Served by zerodist (zerodist.integrations.as_deepspeed): not DeepSpeed."""
import sys

from zerodist.integrations import as_deepspeed

as_deepspeed.install()
sys.modules[__name__] = __import__("importlib").import_module("zerodist.integrations.deepspeed_top")
'''


def alias_directory() -> str:
    """A directory holding the `deepspeed` stub package and its dist-info; put it first on PYTHONPATH."""
    import zerodist

    root = Path(tempfile.gettempdir()) / f"zerodist-as-deepspeed-{zerodist.__version__}-{os.getuid()}"
    stub = root / "deepspeed" / "__init__.py"
    dist_info = root / f"deepspeed-{served_version()}.dist-info"
    if not all(p.exists() for p in (stub, dist_info / "METADATA", root / "sitecustomize.py")):
        _write_atomically(stub, _STUB)
        _write_atomically(root / "sitecustomize.py", _SITECUSTOMIZE)
        _write_atomically(dist_info / "METADATA", _metadata_text())
        _write_atomically(dist_info / "INSTALLER", "zerodist\n")
    return str(root)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the switch on for child processes."""
    env = dict(os.environ if base is None else base)
    paths = [alias_directory(), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env[ENV_FLAG] = "1"
    return env


if __name__ == "__main__":
    sys.stdout.write(alias_directory() + "\n")
