"""Speculative decoding as the driver sees it: its settings, SGLang's counters, the speed-up probe."""
