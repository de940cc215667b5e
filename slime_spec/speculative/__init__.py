"""Speculative decoding outside the engine's step: its settings and counters (read by every process), the probe.

- settings.py: `SpecConfig` and `resolve`: the `--sglang-speculative-*` flags resolved once, as SGLang 0.5.23 does.
- stats.py: SGLang's `meta_info` counters parsed once; the one definition of accept length and accept rate.
- speedup.py: `--spec-speedup-interval`: the same prompts timed on plain and speculative engines.
"""
