"""Flags and the typed configuration every process reads.

- flags.py: the slime-compatible flag table (name, type, default: written once), `ACTED_ON` / `NOT_ACTED_ON`;
  flags_not_acted_on.py and flags_upstream.py: every flag parsed but not acted on, with what ignoring it means.
- args.py: parsing (flags, `--sglang-*` from SGLang's `ServerArgs`, `--config` YAML) into one `Config`.
- run_config.py: the frozen `Config` and its sub-configs (`RolloutConfig`, `TrainConfig`, ...).
"""
