"""The module ``import deepspeed`` gives when zerodist serves it (zerodist.integrations.as_deepspeed).

It is zerodist's top level (``deepspeed.initialize`` is ``zerodist.initialize``, ``deepspeed.comm``
is ``zerodist.comm``) under DeepSpeed's module name, with DeepSpeed's ``__version__`` API level and a
``+zerodist`` label; a name zerodist lacks is an error saying so, never DeepSpeed's.
"""

from __future__ import annotations

import importlib
from typing import Any

import zerodist
from zerodist.integrations.as_deepspeed import served_version

__version__ = served_version()
__path__: list[str] = []  # a package: `deepspeed.X` is served by the finder in as_deepspeed

# Reached as attributes of `deepspeed` where zerodist's own attribute of that name is another module.
_DEEPSPEED_MODULES = {"utils": "deepspeed.utils", "runtime": "deepspeed.runtime"}


def __getattr__(name: str) -> Any:
    if name in _DEEPSPEED_MODULES:
        return importlib.import_module(_DEEPSPEED_MODULES[name])
    try:
        return getattr(zerodist, name)
    except AttributeError:
        raise AttributeError(f"module 'deepspeed' has no attribute {name!r}: `import deepspeed` is served by zerodist "
                             "here (zerodist run --as-deepspeed), which does not provide it; docs/deepspeed.md lists "
                             "DeepSpeed's names and what zerodist gives for each") from None
