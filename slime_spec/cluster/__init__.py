"""The cluster a run uses: joining Ray, GPU placement, the GPUs there are.

- ray_env.py: the `ray.init` arguments (a cluster, or a private local Ray on loopback).
- ray_reaper.py: stops a private Ray whose driver died without shutting it down.
- placement.py: one placement group of one-GPU bundles, sorted by (node IP, GPU id), as slime does.
- gpu_check.py: the GPUs a run asks for against the GPUs there are, before anything starts.
"""
