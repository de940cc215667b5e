"""Weight sync: the trainer's weights, MTP layers included, into every engine after each step.

- convert.py: Megatron <-> HF names and layouts per model family (pure).
- gather.py: TP all-gather, conversion, buckets (target and MTP kept apart).
- protocol.py: which SGLang weight protocol the engine speaks, which `selector` each tensor kind gets, and every
  request body (pure).
- sync.py: `WeightSyncer`, one sync = pause, session, buckets, flush, verify, continue; errors.py: `WeightSyncError`
  (what each engine was verified to serve); report.py: the sync's time split and metrics.
- transports/: how a bucket reaches the engines (distributed, tensor, disk, colocated).
- verify/: coverage, SGLang's checksums, values read back, what each engine serves, the acceptance canary.
Engines are reached only through `slime_spec.fleet.client` (one client, auth, one error type).
"""
