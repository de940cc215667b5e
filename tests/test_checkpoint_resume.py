"""Resume that cannot destroy work (trainer/checkpoint.py): what the run starts from, said before anything starts;
combinations of --load and --save that would overwrite saved iterations refused; saves that fail say why and
leave no partial file."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from slime_spec.trainer import checkpoint
from slime_spec.trainer.checkpoint import CheckpointError, plan_resume


def fake_run(directory: Path, iterations: list[int], position: dict | None = None) -> None:
    for it in iterations:
        checkpoint.save_shard(directory, it, 0, 1, {"vocab_size": 8}, {"w": torch.ones(2)}, None)
        if position is not None:
            checkpoint.write_data_position(directory, it, position)
        checkpoint.mark_latest(directory, it)


def tree_digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_missing_load_with_a_save_dir_holding_checkpoints_is_refused(tmp_path):
    save = tmp_path / "save"
    fake_run(save, [0, 1, 2])
    before = tree_digest(save)
    with pytest.raises(CheckpointError, match=r"--load .*missing does not exist, but --save .* holds checkpoints up "
                                              r"to iteration 2.*--load .*save"):
        plan_resume(str(tmp_path / "missing"), str(save))
    with pytest.raises(CheckpointError, match="no --load is given"):
        plan_resume(None, str(save))
    older = tmp_path / "older"
    fake_run(older, [0])
    with pytest.raises(CheckpointError, match="already holds iterations up to 2"):
        plan_resume(str(older), str(save))
    assert tree_digest(save) == before


def test_same_empty_dir_starts_fresh_and_says_so(tmp_path):
    d = tmp_path / "ckpt"
    plan = plan_resume(str(d), str(d))
    assert plan.load_dir is None
    assert plan.message == (f"starting fresh from --hf-checkpoint: --load {d} does not exist (--load and --save are "
                            "the same directory: its first run)")
    d.mkdir()
    assert "holds no checkpoint" in plan_resume(str(d), str(d)).message
    assert plan_resume(None, None).message == "starting fresh from --hf-checkpoint (no --load given)"


def test_a_real_resume_says_what_it_loads(tmp_path):
    d = tmp_path / "ckpt"
    position = {"consumed": 12, "epoch": 1, "index": 2, "num_prompts": 10, "shuffle": True, "seed": 42}
    fake_run(d, [0, 3], position)
    plan = plan_resume(str(d), str(d))
    assert (plan.load_dir, plan.iteration, plan.data_position) == (str(d), 3, position)
    assert plan.message == (f"resuming from --load {d}: iteration 3 (the next rollout is 4); data position epoch 1, "
                            "index 2 of 10 prompts (12 consumed; shuffle on, seed 42)")


def test_full_disk_says_no_space_left_and_leaves_no_partial_file(tmp_path):
    """/dev/full answers every write with ENOSPC, as a full filesystem does."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    d = tmp_path / "save"
    shard = checkpoint.shard_path(d, 5, 0)
    shard.parent.mkdir(parents=True)
    (shard.parent / "keep.txt").write_text("another rank's file")
    tmp = shard.with_name(shard.name + ".tmp")
    tmp.symlink_to("/dev/full")
    with pytest.raises(CheckpointError, match=rf"cannot write the checkpoint shard {shard}: no space left on device"):
        checkpoint.save_shard(d, 5, 0, 1, {}, {"w": torch.ones(1000)}, None)
    assert not tmp.exists() and not tmp.is_symlink() and not shard.exists()
    marker = d / checkpoint.LATEST
    marker.with_name(marker.name + ".tmp").symlink_to("/dev/full")
    with pytest.raises(CheckpointError, match="no space left on device"):
        checkpoint.mark_latest(d, 5)
    assert not marker.exists()


def test_unwritable_save_dir_is_named(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match=r"cannot write the checkpoint shard .*: not writable"):
            checkpoint.save_shard(d, 0, 0, 1, {}, {"w": torch.ones(1)}, None)
    finally:
        d.chmod(0o700)


def test_pipeline_stages_save_a_file_each_and_load_needs_the_same_stage_count(tmp_path):
    for stage in range(2):
        checkpoint.save_shard(tmp_path, 3, 0, 1, {}, {f"decoder.layers.{stage}.w": torch.full((2,), float(stage))},
                              None, pp_rank=stage, pp_size=2)
    checkpoint.mark_latest(tmp_path, 3)
    assert sorted(p.name for p in (tmp_path / "iter_0000003").iterdir()) == \
        ["tp_rank_00_pp_rank_000.pt", "tp_rank_00_pp_rank_001.pt"]
    shard = checkpoint.load_shard(tmp_path, 0, 1, pp_rank=1, pp_size=2)
    assert list(shard["model"]) == ["decoder.layers.1.w"] and shard["pp_size"] == 2
    for pp_size in (1, 4):  # a file missing for this layout, or one saved with another stage count
        with pytest.raises(ValueError, match=f"saved with pipeline_model_parallel_size=2, now {pp_size}; load it "
                                             "with the same --pipeline-model-parallel-size"):
            checkpoint.load_shard(tmp_path, 0, 1, pp_rank=pp_size - 1, pp_size=pp_size)
