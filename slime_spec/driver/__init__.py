"""The Ray driver: the process that runs the loop and talks to every other part.

- loop.py: `python -m slime_spec.train`: rollout -> train -> sync weights, its modes (colocate, debug).
- report.py: the console line per step, metrics JSONL, wandb, the summary table and the plot.
- run_lock.py: one run per output directory.
- gpu_memory.py: peak memory per GPU over each step (NVML).
- push_weights.py: `slime-spec push-weights`: a checkpoint into running engines through the weight sync.
"""
