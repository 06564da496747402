"""Product behaviours switched off from outside, as A/B arms: the product keeps no switch for a script's sake.

    with one_step_at_a_time(engine.store.runtime):
        ...  # a served batch builds no step ahead while the one before evaluates
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def one_step_at_a_time(runtime):
    """A batch's steps one at a time: the runtime reports it cannot overlap a batch (runtime.overlaps_batch), so
    each step is evaluated before the next is built; the runtime's own answer is back after."""
    runtime.overlaps_batch = lambda rows: False  # an instance attribute over the class's method
    try:
        yield runtime
    finally:
        del runtime.overlaps_batch
