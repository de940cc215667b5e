"""The embedded engine as the weight-sync tests use it: a real `python -m slime_spec.engine` process, read over
HTTP only (generation, SGLang's `/weights_checker` checksums, `/get_weights_by_name`, `/ready`).

`expected_checksums` is the other side of a checksum comparison: what SGLang's `/weights_checker` reports for a
runner serving the given HF tensors (weight_sync/verify/sglang_params.py, pinned against SGLang's own model classes by
tests/conformance/test_weight_checker.py), keyed as the server keys them (a draft's names prefixed `draft.`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import requests
import torch

from slime_spec.fleet.client import EngineClient
from slime_spec.fleet.process import embedded_server_process


class EngineServer:
    """One engine server process on 127.0.0.1 serving `model_path` with `flags`."""

    def __init__(self, model_path: str | Path, flags: list[str], log_path: str | Path):
        self.model_path = Path(model_path)
        self.process = embedded_server_process(model_path, flags, log_path=log_path)

    def launch(self) -> "EngineServer":
        """Start the process without waiting (start several, then `wait_ready` each)."""
        self.process.launch()
        return self

    def wait_ready(self, timeout_s: float = 300) -> "EngineServer":
        self.process.wait_ready(timeout_s)
        self.url = self.process.url
        self.client = EngineClient(self.url)
        return self

    def start(self) -> "EngineServer":
        return self.launch().wait_ready()

    def close(self) -> None:
        self.process.stop()

    def __enter__(self) -> "EngineServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, ids: list[int], n: int = 12, logprobs: bool = False) -> dict:
        return self.client.post("/generate", {"input_ids": ids, "return_logprob": logprobs, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}})

    def checksums(self, selector: str = "all") -> list[dict]:
        """SGLang's `/weights_checker` checksum payload, one entry per rank."""
        return self.client.post("/weights_checker", {"action": "checksum", "selector": selector})["ranks"]

    def served(self, name: str) -> torch.Tensor:
        """A target tensor as served, by its checkpoint name (`/get_weights_by_name`, Llama-family layouts)."""
        reply = self.client.post("/get_weights_by_name", {"name": name, "truncate_size": 1 << 20})
        return torch.tensor(reply.get("result") if isinstance(reply, dict) else reply)  # the client wraps a list

    @property
    def paused(self) -> bool:
        """Generation paused (`/pause_generation` without a `/continue_generation`): SGLang's /ready says 503."""
        code = requests.get(self.url + "/ready", timeout=30).status_code
        assert code in (200, 503), f"{self.url}/ready answered {code}"
        return code == 503

    def reset(self) -> None:
        """Back to the checkpoint it started on, version "default", generation running: how a test sharing a
        module's server starts from the same state as on a fresh one."""
        self.client.post("/continue_generation", {})
        self.client.post("/update_weights_from_disk", {"model_path": str(self.model_path),
                                                       "weight_version": "default"})
        assert not self.paused and self.generate([5], n=1)["meta_info"]["weight_version"] == "default"


def expected_checksums(tensors: Iterable[tuple[str, torch.Tensor]], hf_config: dict, engine: EngineServer,
                       *, mtp_draft: bool) -> dict[str, str]:
    """What `engine`'s /weights_checker reports (all runners) once it serves exactly `tensors` (HF names)."""
    from slime_spec.weight_sync.verify import sglang_params
    dtype = sglang_params.served_dtype(hf_config, engine.client.server_info().get("dtype") or "auto")
    recorder = sglang_params.ServedChecksums(sglang_params.sync_roles(hf_config, dtype, mtp_draft=mtp_draft))
    for name, tensor in tensors:
        recorder.add(name, tensor)
    assert not recorder.incomplete(), recorder.incomplete()
    return recorder.payload_keys()


# The tiny model and EAGLE flags the weight-sync tests serve.
TINY = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
            max_position_embeddings=256)
EAGLE_FLAGS = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
               "--speculative-num-draft-tokens", "3"]


def checkpoint_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def checkpoint_config(path: Path) -> dict:
    import json

    return json.loads((Path(path) / "config.json").read_text())
