"""The module ``import deepspeed`` gives when zerodist serves it (zerodist.integrations.as_deepspeed).

It is zerodist's top level (``deepspeed.initialize`` is ``zerodist.initialize``, ``deepspeed.comm``
is ``zerodist.comm``) under DeepSpeed's module name, with DeepSpeed's ``__version__`` API level and a
``+zerodist`` label; a name zerodist lacks is an error saying so, never DeepSpeed's.
"""

from __future__ import annotations

import importlib
from typing import Any

import zerodist
from zerodist.integrations.as_deepspeed import DEEPSPEED_MODULES, served_version

__version__ = served_version()
__path__: list[str] = []  # a package: `deepspeed.X` is served by the finder in as_deepspeed



def __getattr__(name: str) -> Any:
    # `deepspeed.zero` without an import of its own is what `import deepspeed.zero` gives.
    if f"deepspeed.{name}" in DEEPSPEED_MODULES:
        return importlib.import_module(f"deepspeed.{name}")
    try:
        return getattr(zerodist, name)
    except AttributeError:
        raise AttributeError(f"module 'deepspeed' has no attribute {name!r}: `import deepspeed` is served by zerodist "
                             "here (zerodist run --as-deepspeed), which does not provide it; docs/deepspeed.md lists "
                             "DeepSpeed's names and what zerodist gives for each") from None
