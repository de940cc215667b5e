"""The in-process Trainer in tests: a tiny MiMo checkpoint with one MTP layer, random rollouts, a TrainConfig."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import torch

from slime_spec.config.run_config import TrainConfig
from slime_spec.rollout.sample import Sample
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.trainer import parallel


def tiny_mimo(directory) -> Path:
    """One decoder layer and one MTP layer, in a single-process (TP 1) parallel state."""
    parallel.init_single_process(seed=0)
    return make_tiny_model(directory, arch="mimo", mtp_layers=1, num_layers=1, seed=1)


def random_rollout(n_prompts: int = 2, n: int = 2, seed: int = 0,
                   reward_of: Callable[[int], float] = float) -> list[Sample]:
    """Random prompts/responses, n samples a prompt; sample j of a prompt gets reward_of(j)."""
    rng = random.Random(seed)
    out = []
    for g in range(n_prompts):
        prompt = [rng.randrange(5, 100) for _ in range(5)]
        for j in range(n):
            response = [rng.randrange(5, 100) for _ in range(6)]
            out.append(Sample(index=len(out), group_index=g, prompt="p", tokens=prompt + response,
                              response_length=len(response), reward=reward_of(j)))
    return out


def train_config(path, **kw) -> TrainConfig:
    """Two samples a prompt, a global batch of one prompt, micro batches of one; `kw` overrides any of them."""
    base = dict(hf_checkpoint=str(path), mtp_num_layers=1, lr=1e-3, global_batch_size=2, micro_batch_size=1,
                n_samples_per_prompt=2)
    return TrainConfig(**{**base, **kw})


def built_model(path, **train):
    """(config.json, the trainer's GPTModel of the checkpoint at `path` loaded from its HF weights) in a single
    process (TP 1); `train`: TrainConfig fields (mtp_num_layers, bf16, ...)."""
    from slime_spec.trainer import model as M
    parallel.init_single_process(seed=0)
    hf_config = M.read_hf_config(path)
    model = M.build_gpt_model(hf_config, TrainConfig(hf_checkpoint=str(path), **train))
    M.load_hf_weights(model, M.read_hf_state(path), hf_config, tp_rank=0, tp_size=1)
    return hf_config, model


def model_device(model) -> torch.device:
    """Where the trainer built `model` (CUDA where there is a GPU): the family tests move their inputs there."""
    return next(model.parameters()).device
