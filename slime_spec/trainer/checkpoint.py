"""--save / --load: one torch.save file per tensor-parallel rank.

Layout (Megatron's naming):
  {dir}/latest_checkpointed_iteration.txt        the rollout id of the newest checkpoint
  {dir}/iter_{rollout_id:07d}/tp_rank_{r:02d}.pt    {"format": 1, "rollout_id", "tp_size", "hf_config",
                                                    "model": {megatron name: local shard},
                                                    "optimizer": torch optimizer state_dict or None,
                                                    "draft": online EAGLE3 draft {"model", "optimizer"} or None}
Only data-parallel rank 0 of each TP rank writes; every DP rank reads its TP rank's file.
Shards are stored as Megatron names and local TP shapes, so --load needs the same TP size.
"""

from __future__ import annotations

from pathlib import Path

import torch

FORMAT = 1
LATEST = "latest_checkpointed_iteration.txt"


def save_due(save_interval: int | None, rollout_id: int, num_rollout: int | None = None) -> bool:
    """Whether to save after rollout `rollout_id` (0-based): every save_interval rollouts, and after the last."""
    if not save_interval:
        return False
    return (rollout_id + 1) % save_interval == 0 or (num_rollout is not None and rollout_id + 1 == num_rollout)


def shard_path(directory: str | Path, rollout_id: int, tp_rank: int) -> Path:
    return Path(directory) / f"iter_{rollout_id:07d}" / f"tp_rank_{tp_rank:02d}.pt"


def save_shard(directory: str | Path, rollout_id: int, tp_rank: int, tp_size: int, hf_config: dict,
               model_state: dict[str, torch.Tensor], optimizer_state: dict | None,
               draft_state: dict | None = None) -> Path:
    path = shard_path(directory, rollout_id, tp_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"format": FORMAT, "rollout_id": rollout_id, "tp_size": tp_size, "hf_config": hf_config,
                "model": {k: v.detach().cpu() for k, v in model_state.items()}, "optimizer": optimizer_state,
                "draft": draft_state}, tmp)
    tmp.replace(path)  # a crash mid-write never leaves a truncated shard under the final name
    return path


def mark_latest(directory: str | Path, rollout_id: int) -> None:
    (Path(directory) / LATEST).write_text(f"{rollout_id}\n")


def latest_rollout_id(directory: str | Path) -> int:
    marker = Path(directory) / LATEST
    if not marker.is_file():
        raise FileNotFoundError(f"--load {directory}: no {LATEST} there (not a slime-spec checkpoint directory)")
    return int(marker.read_text().strip())


def load_shard(directory: str | Path, tp_rank: int, tp_size: int, rollout_id: int | None = None) -> dict:
    rollout_id = latest_rollout_id(directory) if rollout_id is None else rollout_id
    path = shard_path(directory, rollout_id, tp_rank)
    if not path.is_file():
        raise FileNotFoundError(f"--load {directory}: {path} is missing")
    shard = torch.load(path, map_location="cpu", weights_only=False)
    if shard.get("format") != FORMAT:
        raise ValueError(f"--load {path}: checkpoint format {shard.get('format')!r}, expected {FORMAT}")
    if shard["tp_size"] != tp_size:
        raise ValueError(f"--load {directory}: saved with tensor_model_parallel_size={shard['tp_size']}, "
                         f"now {tp_size}; load it with the same --tensor-model-parallel-size")
    return shard
