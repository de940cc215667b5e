"""The cluster: joining Ray, GPU placement, the GPUs there are."""
