"""Flags and typed configuration: the flag table, parsing, the configs every process reads."""
