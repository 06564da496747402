"""The decode pipeline: MLX graphs meet the scheduler here (docs/DESIGN.md §2).

prefetch.py: the MoE executors of scheduled routing (prefetch, predicted), which plan their reads with
sched.Scheduler and gather from compute's banks; prefetch_runtime.py: their runtime (predictions in flight, the pause
of the reads ahead, a batch's routing history); steps.py: the token loop (prefill, one step per token)
and the runtime's per-generation hooks.
"""
