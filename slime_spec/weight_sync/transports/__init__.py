"""How a bucket of tensors reaches the engines: distributed, tensor, disk, colocated."""
