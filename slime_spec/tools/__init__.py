"""Command-line tools that write files.

- tiny_model.py: `slime-spec make-tiny-model`: a small random HF checkpoint of any supported family (what tests,
  benchmarks and the demo run on); tiny_families.py: each family's config.json and weights; tiny_tokenizer.py: the
  character-level tokenizer they share.
"""
