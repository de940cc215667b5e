"""A reward for loop runs of a tiny random model (`--custom-rm-path slime_spec.tools.tiny_reward.digit_share`).

A random model never answers right, so a right/wrong reward is 0 for every sample and GRPO's advantages, and the
step's gradients, are all zero. The share of digits in the response differs between a prompt's samples.
"""


def digit_share(sample) -> float:
    return sum(c.isdigit() for c in sample.response) / max(1, len(sample.response))
