"""Where a train process's weights come from: a resumed slime-spec checkpoint, the HF checkpoint, and the KL
reference (--ref-load, or the --hf-checkpoint weights). One model in memory, as slime keeps it: the reference is a
copy of the weights that is swapped in for its forward."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

import torch

from slime_spec.config.run_config import TrainConfig
from slime_spec.trainer import checkpoint
from slime_spec.trainer import model as M
from slime_spec.trainer.parallel import TPInfo

logger = logging.getLogger(__name__)


def shard_of(tp: TPInfo) -> dict:
    """Which checkpoint shard file is this rank's under expert and pipeline parallelism (checkpoint.shard_path)."""
    return dict(ep_rank=tp.ep_rank, ep_size=tp.ep_size, etp_size=tp.etp_size, pp_rank=tp.pp_rank, pp_size=tp.pp_size)


def load_weights(model, source: str, hf_config: dict, tp: TPInfo) -> dict | None:
    """`source` into the model: this rank's shard of a slime-spec checkpoint (returned), or HF weights (None)."""
    if (Path(source) / checkpoint.LATEST).is_file():
        shard = checkpoint.load_shard(source, tp.tp_rank, tp.tp_size, **shard_of(tp))
        M.copy_weights_into(model, shard["model"])
        return shard
    M.load_hf_weights(model, M.read_hf_state(source), hf_config, tp.tp_rank, tp.tp_size, tp.ep_rank, tp.ep_size,
                      tp.etp_rank, tp.etp_size)
    return None


def load_initial(model, train: TrainConfig, hf_config: dict, tp: TPInfo) -> dict | None:
    """--load when it holds a checkpoint (resume: its shard is returned), else the HF checkpoint (None)."""
    if train.load and (Path(train.load) / checkpoint.LATEST).is_file():
        shard = load_weights(model, train.load, hf_config, tp)
        logger.info("resumed from %s at rollout %d", train.load, shard["rollout_id"])
        return shard
    if train.load:
        logger.info("--load %s holds no checkpoint yet; starting from --hf-checkpoint", train.load)
    return load_weights(model, train.hf_checkpoint, hf_config, tp)


def reference_weights(model, train: TrainConfig, hf_config: dict, tp: TPInfo,
                      resumed: bool) -> dict[str, torch.Tensor]:
    """The KL reference: --ref-load (an HF or slime-spec checkpoint) or the --hf-checkpoint weights. The model's
    own weights are left as they were."""
    if not resumed and not train.ref_load:  # the model holds exactly the --hf-checkpoint weights
        return M.weights_copy(model)
    current = M.weights_copy(model)
    load_weights(model, train.ref_load or train.hf_checkpoint, hf_config, tp)
    ref = M.weights_copy(model)
    M.copy_weights_into(model, current)
    return ref


@contextlib.contextmanager
def swapped_in(model, weights: dict[str, torch.Tensor]) -> Iterator:
    """The model with `weights` (the reference) in place of its own for the block, restored after it."""
    current = M.weights_copy(model)
    M.copy_weights_into(model, weights)
    try:
        yield model
    finally:
        M.copy_weights_into(model, current)
