"""Weight sync: the trainer's weights, MTP layers included, into every engine after each step.

- convert.py: Megatron <-> HF names and layouts per model family (pure).
- gather.py: TP all-gather, conversion, buckets (target and MTP kept apart).
- protocol.py: which SGLang weight protocol the engine speaks, which `selector` each tensor kind gets,
  and every request body (pure).
- weight_sync/transports/http_transports.py: distributed (process group + broadcast), tensor (colocated), disk.
- weight_sync/transports/tensor_payload.py: tensors as `/update_weights_from_tensor` entries (CUDA IPC handles or
bytes, flattened buckets).
- weight_sync/transports/colocated.py: per-rank buckets of colocated trainer ranks, each engine TP rank's entry from
its own GPU.
- verify.py: coverage of the served weights and checksum comparison (pure).
- weight_sync/verify/sglang_params.py: sent tensors -> the parameters SGLang's model classes serve, hashed by SGLang's
own function.
- weight_sync/verify/readback.py: served values against the sent tensors (/get_weights_by_name slices; CPU checksums).
- sync.py: `WeightSyncer`, one sync = pause, session, buckets, flush, verify, continue.
- weight_sync/verify/canary.py: the acceptance canary after each sync.
Engines are reached only through `slime_spec.fleet.client` (one client, auth, one error type).
"""
