"""How a bucket of tensors reaches the engines.

- http_transports.py: `distributed` (process group + broadcast), `tensor` (colocated) and `disk`.
- tensor_payload.py: tensors as `/update_weights_from_tensor` entries (CUDA IPC handles or bytes).
- colocated.py: per-rank buckets of colocated trainer ranks, each engine TP rank's entry from its own GPU.
"""
