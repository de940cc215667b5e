"""What a sync verifies, and how.

- after_sync.py: what the syncer checks around a sync (baseline, coverage, values, a failed sync's verdict).
- coverage.py: every served weight written; checksums compared (pure).
- sglang_params.py: sent tensors -> the parameters SGLang's model classes serve, hashed by SGLang's function.
- readback.py: served values read back against the sent tensors; served_state.py: what each engine serves.
- canary.py: the acceptance canary after each sync.
"""
