"""`make demo` (`python -m slime_spec.demo`): the whole loop on the scratchpad task.

- run.py: build a tiny MiMo-style model, SFT it, then GRPO with NEXTN rollout and online MTP training.
- task.py: the synthetic task: 3-digit addition worked column by column (its rewards: rollout/scratchpad.py).
"""
