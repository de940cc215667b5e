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
from slime_spec.tools.tiny_model import make_tiny_model
from tests.helpers.engine_server import EAGLE_FLAGS, TINY, EngineServer

FLAGS = [*EAGLE_FLAGS, "--random-seed", "0"]  # the session engine's (tests/conftest.py tiny_mimo_engine)
PROMPTS = ["hello world", "the cat sat on", "abc abc abc"]


@pytest.fixture(scope="module")
def models(tiny_mimo_engine, tmp_path_factory):
    """The session engine's tiny MiMo (old), another seed of it (new), and a directory of the module's."""
    root = tmp_path_factory.mktemp("push_weights")
    return tiny_mimo_engine.model_path, make_tiny_model(root / "new", arch="mimo", seed=1, **TINY), root


def greedy(url: str) -> list[list[int]]:
    outs = requests.post(url + "/generate", json={"text": PROMPTS, "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}, timeout=120).json()
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def new_model_output(models):
    """Greedy output of a fresh engine started on the new checkpoint."""
    _, new, root = models
    with EngineServer(new, FLAGS, log_path=root / "reference.log") as reference:
        return greedy(reference.url)


@pytest.fixture
def server(tiny_mimo_engine):
    """The session's engine on the old checkpoint, version "default", generating (EngineServer.reset)."""
    tiny_mimo_engine.reset()
    return tiny_mimo_engine


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_push_changes_served_model_and_check_compares_values(models, server, new_model_output, transport, capsys):
    _, new, _ = models
    before = greedy(server.url)
    assert before != new_model_output  # otherwise the test could not see the push
    code = cli_main(["push-weights", "--hf-checkpoint", str(new), "--engine-url", server.url,
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
    assert greedy(server.url) == new_model_output


def test_wrong_shape_fails_naming_the_tensor(models, server, capsys):
    _, _, root = models
    bad = make_tiny_model(root / "bad", arch="mimo", seed=2, **TINY)
    state = load_file(str(bad / "model.safetensors"))
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(32, 48)  # intermediate 64 in the served model
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    before = greedy(server.url)
    code = cli_main(["push-weights", "--hf-checkpoint", str(bad), "--engine-url", server.url, "--transport", "tensor",
                     "--check", "--update-weight-buffer-size", str(1 << 30)])
    out = capsys.readouterr()
    assert code == 1
    assert "model.layers.1.mlp.down_proj.weight" in out.out and "push-weights: FAILED" in out.err
    assert server.url in out.out
    assert greedy(server.url) == before  # one all-or-nothing request: the engine kept the old model


def test_missing_config_is_a_flag_error(tmp_path, capsys):
    assert cli_main(["push-weights", "--hf-checkpoint", str(tmp_path), "--engine-url", "http://127.0.0.1:1"]) == 2
    assert "--hf-checkpoint" in capsys.readouterr().err


def test_cli_lists_push_weights(capsys):
    assert cli_main(["--help"]) == 0
    assert "push-weights" in capsys.readouterr().out
