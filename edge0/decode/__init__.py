"""The decode loop, written once: what `edge0 run`, `edge0 serve` and `edge0 chat` generate with.

    request.py   GenRequest, Figures, the finish reasons (plain dataclasses)
    sampling.py  mlx-lm's samplers and logits processors; a request's penalties
    text.py      the streaming detokenizer, stop strings, Tally (when and why a sequence ends)
    prefill.py   PREFILL_STEP and the prompt's chunks into the KV cache
    step.py      the step's head (forward), the overlap rule of a sequence alone, StepTimes
    rows.py      a batch's rows and steps as plain data (Sequence, Built, StepPlan), forced tokens, reads charged
    batch.py     the decode loop: sequences join and leave a batch's steps at step boundaries; alone, a batch of one
    loop.py      a sequence alone: one generation (generate) and a model's steps for scoring (generate_steps)
    cache.py     the prompt cache: earlier generations' KV caches, reused by a shared prefix

The runtime's hooks it calls are compute/runtime.py's Hooks, no-ops by default.
"""

from .request import CANCELLED, LENGTH, STOP, Figures, GenRequest

__all__ = ["GenRequest", "Figures", "STOP", "LENGTH", "CANCELLED"]
