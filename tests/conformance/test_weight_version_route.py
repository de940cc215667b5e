"""Which route carries the live weight version: SGLang 0.5.23's own `/server_info` and `/model_info` handlers.

The embedded engine runs SGLang's HTTP server and TokenizerManager unchanged (`python -m slime_spec.engine`),
so the routes read here are SGLang's handler code: `/server_info` is the startup configuration
(`build_server_info`), `/model_info` reads the TokenizerManager's config in effect, which
`/update_weight_version` changes. Every reader of the weight version in slime-spec (fleet fence, syncer,
served-state read-back, push-weights) must read `/model_info`.
"""

from __future__ import annotations

import types

import pytest
import requests

from slime_spec.fleet.actor import Engine
from slime_spec.fleet.client import EngineClient
from slime_spec.fleet.process import embedded_server_process
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.weight_sync.verify.served_state import weight_version_of


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_version")
    model = make_tiny_model(root / "llama", arch="llama", vocab_size=64, hidden_size=32, num_layers=1,
                            intermediate_size=64, max_position_embeddings=128)
    with embedded_server_process(model, ["--weight-version", "v0"], log_path=root / "engine.log").start(300) as s:
        yield s


def test_update_weight_version_is_reported_by_model_info_not_server_info(server):
    get = lambda path: requests.get(server.url + path, timeout=60).json()  # noqa: E731
    info = get("/server_info")
    assert "launch_command" in info and info["weight_version"] == "v0"  # SGLang's build_server_info
    assert get("/model_info")["weight_version"] == "v0"
    reply = requests.post(server.url + "/update_weight_version",
                          json={"new_version": "v7", "abort_all_requests": False}, timeout=60)
    assert reply.status_code == 200 and reply.json()["new_version"] == "v7"
    assert get("/model_info")["weight_version"] == "v7"
    assert get("/server_info")["weight_version"] == "v0"  # the startup configuration, unchanged


def test_every_reader_of_the_weight_version_reads_model_info(server):
    requests.post(server.url + "/update_weight_version", json={"new_version": "v8", "abort_all_requests": False},
                  timeout=60).raise_for_status()
    client = EngineClient(server.url)
    assert weight_version_of(client) == "v8"  # syncer, served-state read-back, push-weights
    assert Engine.weight_version(types.SimpleNamespace(client=client)) == "v8"  # the fleet's un-fence check
