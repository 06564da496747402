"""Edge0: serve Mixture-of-Experts models whose weights do not fit in memory.

The public API, here on the built-in demo model (`EngineConfig(model="stores/q3")` opens a store of your own; its
settings nest by concern: `EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(slots=16))`):

    from edge0 import EngineConfig, GenRequest, open_engine

    with open_engine(EngineConfig()) as engine:
        req = GenRequest(prompt=engine.encode_text("def fib(n):"), max_tokens=32)
        figures = engine.generate(req, emit=lambda text: print(text, end=""))
    print()
    print(figures.line())

The names are imported on first use: `import edge0` (and so `edge0 --help`) does not load MLX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_PUBLIC = {"open_engine": "edge0.engine", "EngineConfig": "edge0.config", "GenRequest": "edge0.decode.request",
           "Figures": "edge0.decode.request",
           **{c: "edge0.config" for c in ("RoutingConfig", "IOConfig", "KernelConfig", "ServingConfig")}}
__all__ = [*_PUBLIC, "__version__"]

if TYPE_CHECKING:
    from .config import EngineConfig, IOConfig, KernelConfig, RoutingConfig, ServingConfig
    from .engine import open_engine
    from .decode.request import Figures, GenRequest


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'edge0' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # found once; later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
