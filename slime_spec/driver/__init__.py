"""The Ray driver: the training loop, what it reports, `push-weights`."""
