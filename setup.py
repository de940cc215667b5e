from setuptools import find_packages, setup

setup(
    name="slime-spec",
    version="0.1.0",
    description="Speculative rollout for RL training in the style of slime: SGLang engines, Megatron trainers, Ray.",
    packages=find_packages(include=["slime_spec", "slime_spec.*"]),
    python_requires=">=3.11",
    # torch and sglang are installed separately (see README and Makefile): torch pinned to a
    # CPU build on CPU machines, sglang with --no-deps there and in full on GPU clusters.
    install_requires=[],
    entry_points={"console_scripts": ["slime-spec=slime_spec.cli:main"]},
)
