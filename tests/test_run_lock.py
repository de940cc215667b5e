"""One run per output directory (slime_spec/driver/run_lock.py): a second run is refused naming the first; a lock
whose run is gone is taken over; the lock goes when the run ends."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from slime_spec.driver.run_lock import LOCK_NAME, RunLock, RunLocked


def test_second_run_into_the_same_dir_is_refused_naming_the_first(tmp_path):
    out, save = tmp_path / "out", tmp_path / "save"
    with RunLock([out, save], ["--output-dir", str(out)]) as first:
        lock = json.loads((out / LOCK_NAME).read_text())
        assert lock["pid"] == first.identity["pid"] and lock["host"] == socket.gethostname()
        with pytest.raises(RunLocked, match=rf"{save} is in use by another run: pid {lock['pid']} on host "
                                            rf"{socket.gethostname()}, started .* UTC \(python -m slime_spec.train"):
            RunLock([tmp_path / "other_out", save]).acquire()
        assert not (tmp_path / "other_out" / LOCK_NAME).exists()  # a refused run leaves no lock behind
    assert not (out / LOCK_NAME).exists() and not (save / LOCK_NAME).exists()


def test_a_lock_whose_run_is_gone_is_taken_over(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                  "started": "2026-01-01 00:00:00 UTC", "command": "x"}))
    with RunLock([tmp_path]):
        assert f"pid {dead.pid}" in capsys.readouterr().err
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_from_another_host_is_refused_with_the_file_to_delete(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "s", "command": "c"}))
    with pytest.raises(RunLocked, match=rf"pid 1 on host elsewhere.*delete {tmp_path / LOCK_NAME}"):
        RunLock([tmp_path]).acquire()


def test_training_into_a_locked_output_dir_is_refused_before_anything_starts(tmp_path, capsys):
    from slime_spec.driver.loop import main
    from slime_spec.tools.tiny_model import make_tiny_model
    model = make_tiny_model(tmp_path / "model", arch="llama", hidden_size=32, num_layers=1, intermediate_size=64,
                            max_position_embeddings=256, seed=0)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"input": "1+1=", "label": "2"}) + "\n")
    out = tmp_path / "out"
    with RunLock([out]) as other:
        rc = main(["--hf-checkpoint", str(model), "--rollout-backend", "embedded", "--prompt-data", str(data),
                   "--label-key", "label", "--rm-type", "exact_match", "--output-dir", str(out)])
        assert rc == 2
        assert f"{out} is in use by another run: pid {other.identity['pid']}" in capsys.readouterr().err
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == other.identity["pid"]  # still the other run's
