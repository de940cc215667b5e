"""--save / --load: one torch.save file per tensor-parallel rank.

Layout (Megatron's naming):
  {dir}/latest_checkpointed_iteration.txt        the rollout id of the newest checkpoint
  {dir}/iter_{rollout_id:07d}/data_position.json  where the prompt stream stands after that rollout (rollout/data.py)
  {dir}/iter_{rollout_id:07d}/tp_rank_{r:02d}.pt    {"format": 1, "rollout_id", "tp_size", "ep_size", "etp_size",
                                                    "hf_config",
                                                    "model": {megatron name: local shard},
                                                    "optimizer": torch optimizer state_dict or None,
                                                    "draft": online EAGLE3 draft {"model", "optimizer"} or None}
Under expert parallelism (--expert-model-parallel-size E > 1) each (TP rank, EP rank) has its own file,
tp_rank_{r:02d}_ep_rank_{e:02d}.pt: its experts (local numbers) and the replicated rest. Under pipeline parallelism
(--pipeline-model-parallel-size P > 1) each stage has its own files, `_pp_rank_{p:03d}` after the TP rank: its own
layers, named by their number in the whole model.
Only the first replica (expert-data-parallel rank 0, which is data-parallel rank 0 without EP) of each shard
writes; every rank reads its shard's file. Shards are stored as Megatron names and local TP / EP shapes, so
--load needs the same TP, EP and PP sizes.
Every file is written to a temporary name and renamed into place; a failed write removes it and says why.
`plan_resume` decides, before anything starts, whether a run resumes or starts fresh, and refuses a
combination of --load and --save that would overwrite saved iterations.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from slime_spec.config.run_config import expert_tensor_parallel_size

FORMAT = 1
LATEST = "latest_checkpointed_iteration.txt"
DATA_POSITION = "data_position.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or would overwrite saved work; the message says why and what to do."""


def _free_space(path: Path) -> str:
    for p in (path, *path.parents):
        if p.exists():
            return f"{shutil.disk_usage(p).free / 2**20:.0f} MiB free there"
    return "free space unknown"


@contextlib.contextmanager
def _written(path: Path, what: str):
    """Yield a binary file at a temporary name next to `path`; renamed to `path` once complete. On any failure
    the temporary file is removed and CheckpointError names the path and the cause."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)  # a crash mid-write never leaves a truncated file under the final name
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            cause = f"no space left on device ({_free_space(path.parent)})"
        elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            cause = f"not writable ({e.strerror})"
        else:
            cause = e.strerror or str(e)
        raise CheckpointError(f"cannot write {what} {path}: {cause}; the partial file was removed") from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_due(save_interval: int | None, rollout_id: int, num_rollout: int | None = None) -> bool:
    """Whether to save after rollout `rollout_id` (0-based): every save_interval rollouts, and after the last."""
    if not save_interval:
        return False
    return (rollout_id + 1) % save_interval == 0 or (num_rollout is not None and rollout_id + 1 == num_rollout)


def shard_path(directory: str | Path, rollout_id: int, tp_rank: int, ep_rank: int = 0, ep_size: int = 1,
               pp_rank: int = 0, pp_size: int = 1) -> Path:
    name = f"tp_rank_{tp_rank:02d}" + (f"_pp_rank_{pp_rank:03d}" if pp_size > 1 else "") + \
        (f"_ep_rank_{ep_rank:02d}" if ep_size > 1 else "")
    return Path(directory) / f"iter_{rollout_id:07d}" / f"{name}.pt"


def save_shard(directory: str | Path, rollout_id: int, tp_rank: int, tp_size: int, hf_config: dict,
               model_state: dict[str, torch.Tensor], optimizer_state: dict | None,
               draft_state: dict | None = None, ep_rank: int = 0, ep_size: int = 1,
               etp_size: int | None = None, pp_rank: int = 0, pp_size: int = 1) -> Path:
    path = shard_path(directory, rollout_id, tp_rank, ep_rank, ep_size, pp_rank, pp_size)
    created = not path.parent.exists()
    try:
        with _written(path, "the checkpoint shard") as f:  # a file object: a full disk raises ENOSPC, not a zip error
            torch.save({"format": FORMAT, "rollout_id": rollout_id, "tp_size": tp_size, "ep_size": ep_size,
                        "pp_size": pp_size,
                        "etp_size": expert_tensor_parallel_size(tp_size, etp_size), "hf_config": hf_config,
                        "model": {k: v.detach().cpu() for k, v in model_state.items()}, "optimizer": optimizer_state,
                        "draft": draft_state}, f)
    except BaseException:
        if created and path.parent.is_dir() and not any(path.parent.iterdir()):
            path.parent.rmdir()
        raise
    return path


def mark_latest(directory: str | Path, rollout_id: int) -> None:
    with _written(Path(directory) / LATEST, "the checkpoint marker") as f:
        f.write(f"{rollout_id}\n".encode())


def write_data_position(directory: str | Path, rollout_id: int, position: dict) -> None:
    with _written(Path(directory) / f"iter_{rollout_id:07d}" / DATA_POSITION, "the data position") as f:
        f.write(json.dumps(position, sort_keys=True).encode())


def read_data_position(directory: str | Path, rollout_id: int) -> dict | None:
    """The data position saved with iteration `rollout_id`, or None for a checkpoint saved without one."""
    path = Path(directory) / f"iter_{rollout_id:07d}" / DATA_POSITION
    return json.loads(path.read_text()) if path.is_file() else None


def saved_iteration(directory: str | Path | None) -> int | None:
    """The newest iteration a directory holds (its marker), or None when it holds no checkpoint."""
    if not directory or not (Path(directory) / LATEST).is_file():
        return None
    return latest_rollout_id(directory)


@dataclass(frozen=True)
class ResumePlan:
    """What the run starts from: a checkpoint (`load_dir`, `iteration`) or --hf-checkpoint; `message` says which
    and why, for the console."""

    load_dir: str | None
    iteration: int | None
    data_position: dict | None
    message: str


def describe_position(position: dict | None) -> str:
    if position is None:
        return ("no data position saved with it (an older checkpoint): prompts continue at the next rollout id x "
                "--rollout-batch-size")
    shuffle = f"on, seed {position['seed']}" if position["shuffle"] else "off"
    return (f"data position epoch {position['epoch']}, index {position['index']} of {position['num_prompts']} "
            f"prompts ({position['consumed']} consumed; shuffle {shuffle})")


def plan_resume(load: str | None, save: str | None) -> ResumePlan:
    """Resume from --load when it holds a checkpoint, else start fresh; raise CheckpointError (before anything
    starts) when the run would write over iterations --save already holds."""
    save_latest = saved_iteration(save)
    same = bool(load and save) and Path(load).resolve() == Path(save).resolve()
    load_latest = saved_iteration(load)
    if load_latest is not None:
        if save and not same and save_latest is not None and save_latest > load_latest:
            raise CheckpointError(
                f"--load {load} resumes after iteration {load_latest}, but --save {save} already holds iterations up "
                f"to {save_latest}, which the run would overwrite. Resume from the newest with --load {save}, or "
                f"give a --save that holds no checkpoint")
        position = read_data_position(load, load_latest)
        return ResumePlan(load, load_latest, position,
                          f"resuming from --load {load}: iteration {load_latest} (the next rollout is "
                          f"{load_latest + 1}); {describe_position(position)}")
    if load:
        why = "does not exist" if not Path(load).exists() else f"holds no checkpoint (no {LATEST})"
        if save_latest is not None:
            raise CheckpointError(
                f"--load {load} {why}, but --save {save} holds checkpoints up to iteration {save_latest}: starting "
                f"fresh would overwrite them. Resume them with --load {save}, or give a --save that holds no "
                f"checkpoint")
        pattern = " (--load and --save are the same directory: its first run)" if same else ""
        return ResumePlan(None, None, None,
                          f"starting fresh from --hf-checkpoint: --load {load} {why}{pattern}")
    if save_latest is not None:
        raise CheckpointError(
            f"--save {save} holds checkpoints up to iteration {save_latest} and no --load is given: starting fresh "
            f"would overwrite them. Resume with --load {save}, or give a --save that holds no checkpoint")
    return ResumePlan(None, None, None, "starting fresh from --hf-checkpoint (no --load given)")


def latest_rollout_id(directory: str | Path) -> int:
    marker = Path(directory) / LATEST
    if not marker.is_file():
        raise FileNotFoundError(f"--load {directory}: no {LATEST} there (not a slime-spec checkpoint directory)")
    return int(marker.read_text().strip())


def load_shard(directory: str | Path, tp_rank: int, tp_size: int, rollout_id: int | None = None,
               ep_rank: int = 0, ep_size: int = 1, etp_size: int | None = None, pp_rank: int = 0,
               pp_size: int = 1) -> dict:
    rollout_id = latest_rollout_id(directory) if rollout_id is None else rollout_id
    path = shard_path(directory, rollout_id, tp_rank, ep_rank, ep_size, pp_rank, pp_size)
    saved_pp = _saved_pp_size(directory, rollout_id, tp_rank) if not path.is_file() else None
    if saved_pp is not None and saved_pp != pp_size:
        _pp_mismatch(directory, saved_pp, pp_size)
    if not path.is_file() and ep_size != 1 and shard_path(directory, rollout_id, tp_rank).is_file():
        raise ValueError(f"--load {directory}: saved with expert_model_parallel_size=1, now {ep_size}; load it "
                         f"with --expert-model-parallel-size 1")
    if not path.is_file():
        raise FileNotFoundError(f"--load {directory}: {path} is missing")
    shard = torch.load(path, map_location="cpu", weights_only=False)
    if shard.get("format") != FORMAT:
        raise ValueError(f"--load {path}: checkpoint format {shard.get('format')!r}, expected {FORMAT}")
    if shard.get("pp_size", 1) != pp_size:
        _pp_mismatch(directory, shard.get("pp_size", 1), pp_size)
    if shard["tp_size"] != tp_size:
        raise ValueError(f"--load {directory}: saved with tensor_model_parallel_size={shard['tp_size']}, "
                         f"now {tp_size}; load it with the same --tensor-model-parallel-size")
    if shard.get("ep_size", 1) != ep_size:
        raise ValueError(f"--load {directory}: saved with expert_model_parallel_size={shard.get('ep_size', 1)}, "
                         f"now {ep_size}; load it with the same --expert-model-parallel-size")
    saved_etp, etp_size = shard.get("etp_size", shard["tp_size"]), expert_tensor_parallel_size(tp_size, etp_size)
    if saved_etp != etp_size:  # shards saved before the field: expert TP was the TP size
        raise ValueError(f"--load {directory}: saved with expert_tensor_parallel_size={saved_etp}, now {etp_size}; "
                         f"load it with the same --expert-tensor-parallel-size")
    return shard


def _pp_mismatch(directory, saved: int, now: int):
    raise ValueError(f"--load {directory}: saved with pipeline_model_parallel_size={saved}, now {now}; load it with "
                     f"the same --pipeline-model-parallel-size")


def _saved_pp_size(directory: str | Path, rollout_id: int, tp_rank: int) -> int | None:
    """The pipeline size an iteration's file names show (its highest stage + 1; None: no shard of this TP rank)."""
    folder = Path(directory) / f"iter_{rollout_id:07d}"
    names = [p.name for p in folder.glob(f"tp_rank_{tp_rank:02d}*.pt")]
    if not names:
        return None
    stages = [int(n.split("_pp_rank_")[1][:3]) for n in names if "_pp_rank_" in n]
    return max(stages) + 1 if stages else 1
