"""`slime-spec doctor`: every check of a configuration before launch, and the code registry.

- codes.py: every finding's code, level, message and fix (`Rule`); checks only fill these in.
- spec_checks.py: the speculative-decoding checks, pure functions over the flags and config.json files.
- flag_checks.py: ranges of single flags and relations between flags, as data.
- preflight.py: the run's files (prompt data, output directories, --load / --save).
- diagnose.py: the command itself, which runs them all and prints each engine's command line.
"""
