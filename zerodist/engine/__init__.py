"""Layer 7: `initialize()` and the `Engine`. Composes the layers below; implements none of them."""

from zerodist.engine.engine import Engine
from zerodist.engine.initialize import initialize

__all__ = ["Engine", "initialize"]
