"""Command-line tools that write files: tiny checkpoints."""
