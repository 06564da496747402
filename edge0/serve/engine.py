"""Transitional: the engine moved to edge0/engine.py and the generation loop to edge0/generation.py."""

from ..engine import Engine  # noqa: F401
from ..generation import Figures, GenRequest, StopFilter  # noqa: F401
