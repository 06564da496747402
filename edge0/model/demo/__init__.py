"""The built-in model: a small Qwen3-MoE trained by `edge0 train base --preset demo` (see MODEL_CARD.md)."""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
DEMO_STORE = DEMO_DIR / "store"  # the int4 Edge0 store `edge0 run` uses by default
DEMO_FP = DEMO_DIR / "fp"  # its bf16 mlx-lm source checkpoint
DEMO_PROMPT = "def fibonacci(n):\n    if n"  # ends inside a line: a prompt ending in whitespace splits the BPE's "\\n    " token
