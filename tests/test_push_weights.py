"""`slime-spec push-weights` end to end against the embedded engine (a real server process over HTTP).

The engine serves a tiny MiMo (native MTP draft); a second checkpoint of the same shapes but another
seed is pushed through the trainer's sync code. Afterwards greedy /generate must equal a fresh engine
started on that second checkpoint, and --check must have compared values.
"""

from __future__ import annotations

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from slime_spec.cli import main as cli_main
from slime_spec.fleet.process import embedded_server_process
from slime_spec.tools.tiny_model import make_tiny_model

TINY = dict(arch="mimo", vocab_size=64, hidden_size=32, num_layers=2, intermediate_size=64,
            max_position_embeddings=256)
FLAGS = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "3", "--random-seed", "0"]
PROMPTS = ["hello world", "the cat sat on", "abc abc abc"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("push_weights")
    return make_tiny_model(root / "old", seed=0, **TINY), make_tiny_model(root / "new", seed=1, **TINY), root


def greedy(url: str) -> list[list[int]]:
    outs = requests.post(url + "/generate", json={"text": PROMPTS, "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}, timeout=120).json()
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def new_model_output(models):
    _, new, root = models
    with embedded_server_process(new, FLAGS, log_path=root / "reference.log").start(300) as s:
        return greedy(s.url)


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_push_changes_served_model_and_check_compares_values(models, new_model_output, transport, capsys):
    old, new, root = models
    with embedded_server_process(old, FLAGS, log_path=root / f"{transport}.log").start(300) as s:
        before = greedy(s.url)
        assert before != new_model_output  # otherwise the test could not see the push
        code = cli_main(["push-weights", "--hf-checkpoint", str(new), "--engine-url", s.url,
                         "--transport", transport, "--check", "--update-weight-buffer-size", "20000",
                         "--weight-version", f"pushed-{transport}"])
        out = capsys.readouterr()
        assert code == 0, out.out + out.err
        # SGLang's checksums of every tensor the target and MTP-draft runners serve (SGLang's names and values,
        # pinned by tests/conformance/test_weight_checker.py) and a sample read by name
        assert "values checked by get_weights_by_name + weights_checker" in out.out
        assert "0 problem(s)" in out.out
        assert f"weight_version 'pushed-{transport}'" in out.out  # read from /model_info
        assert "push-weights: OK" in out.out
        assert "MTP tensors" in out.out and " + 0 MTP" not in out.out
        assert greedy(s.url) == new_model_output


def test_wrong_shape_fails_naming_the_tensor(models, capsys):
    old, _, root = models
    bad = make_tiny_model(root / "bad", seed=2, **TINY)
    state = load_file(str(bad / "model.safetensors"))
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(32, 48)  # intermediate 64 in the served model
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with embedded_server_process(old, FLAGS, log_path=root / "bad.log").start(300) as s:
        before = greedy(s.url)
        code = cli_main(["push-weights", "--hf-checkpoint", str(bad), "--engine-url", s.url, "--transport", "tensor",
                         "--check", "--update-weight-buffer-size", str(1 << 30)])
        out = capsys.readouterr()
        assert code == 1
        assert "model.layers.1.mlp.down_proj.weight" in out.out and "push-weights: FAILED" in out.err
        assert s.url in out.out
        assert greedy(s.url) == before  # one all-or-nothing request: the engine kept the old model


def test_missing_config_is_a_flag_error(tmp_path, capsys):
    assert cli_main(["push-weights", "--hf-checkpoint", str(tmp_path), "--engine-url", "http://127.0.0.1:1"]) == 2
    assert "--hf-checkpoint" in capsys.readouterr().err


def test_cli_lists_push_weights(capsys):
    assert cli_main(["--help"]) == 0
    assert "push-weights" in capsys.readouterr().out
