"""`slime-spec push-weights --transport distributed --check` against a server assembled from SGLang's own code.

The server (sglang_server.py) is SGLang 0.5.23's http_server + TokenizerManager + DetokenizerManager, with a
scheduler process whose weight path is SGLang's SchedulerWeightUpdaterManager, TpModelWorker methods, model-runner
WeightUpdater and WeightChecker over SGLang's own model classes: a MiMo with its MiMoMTP draft (EAGLE) and a Llama.
Each serves one checkpoint; the push sends another of the same shapes (another seed). Then:
- push-weights exits 0: every bucket taken, the version read back from /model_info, and SGLang's checksums of
  every served tensor (both runners) equal to the trainer side's;
- by value: every parameter and buffer each runner serves after the push (written by the server after
  /end_weight_update) equals what SGLang's model classes hold when loaded from the pushed checkpoint directly
  (sglang_models.py, a process of its own).
The same command against the embedded engine is tests/test_push_weights.py.
"""

from __future__ import annotations

import contextlib
import io
import sys

import pytest
import torch
from safetensors.torch import load_file

from slime_spec.cli import main as cli_main
from slime_spec.common.net import free_port
from slime_spec.fleet.process import ServerProcess
from slime_spec.tools.tiny_model import make_tiny_model
from tests.conformance.sglang_models import answers_in_own_process
from tests.conformance.sglang_server import STATE_OUT

TINY = dict(vocab_size=64, hidden_size=32, num_layers=2, intermediate_size=64, max_position_embeddings=256)
FLAGS = {"mimo": ["--trust-remote-code", "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
                  "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"],
         "llama": []}


def assembled_server(model, arch: str, root) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "tests.conformance.sglang_server", "--model-path", str(model), "--host",
            "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32", "--skip-server-warmup",
            *FLAGS[arch]]
    return ServerProcess(argv, host="127.0.0.1", port=port, log_path=root / f"{arch}.log",
                         env={STATE_OUT: str(root / f"{arch}-served.pt")}, expect_model_path=str(model))


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """Per architecture: the push-weights exit code and output, what the server serves after the push, and what
    SGLang's model classes hold when loaded from the pushed checkpoint."""
    root = tmp_path_factory.mktemp("push_sglang")
    ckpts = {arch: (make_tiny_model(root / f"{arch}-old", arch=arch, seed=0, **TINY),
                    make_tiny_model(root / f"{arch}-new", arch=arch, seed=1, **TINY)) for arch in FLAGS}
    servers = {arch: assembled_server(old, arch, root) for arch, (old, _) in ckpts.items()}
    jobs = [{"arch": arch, "weights": str(new / "model.safetensors"), "config": str(new / "config.json"),
             "dtype": "float32"} for arch, (_, new) in ckpts.items()]
    results = {}
    try:
        for server in servers.values():
            server.launch()
        references = answers_in_own_process(jobs, root)  # while the servers start
        for arch, server in servers.items():
            server.wait_ready(300)
            report = io.StringIO()
            with contextlib.redirect_stdout(report):
                code = cli_main(["push-weights", "--hf-checkpoint", str(ckpts[arch][1]), "--engine-url", server.url,
                                 "--transport", "distributed", "--check", "--update-weight-buffer-size", "20000",
                                 "--weight-version", f"pushed-{arch}"])
            results[arch] = {"code": code, "report": report.getvalue(),
                             "served": torch.load(root / f"{arch}-served.pt"),
                             "reference": references[list(FLAGS).index(arch)]["state"],
                             "old": load_file(str(ckpts[arch][0] / "model.safetensors"))}
    finally:
        for server in servers.values():
            server.stop()
    return results


@pytest.mark.parametrize("arch", list(FLAGS))
def test_push_weights_check_passes_and_every_served_tensor_equals_sglangs_own_load(pushed, arch):
    out = pushed[arch]
    assert out["code"] == 0, out["report"]
    report = out["report"]
    assert "values checked by" in report and "weights_checker: " in report and "0 problem(s)" in report, report
    assert f"weight_version 'pushed-{arch}'" in report and "push-weights: OK" in report  # from /model_info
    assert (" + 0 MTP" not in report) == (arch == "mimo"), report
    served, reference = out["served"], out["reference"]
    assert served.keys() == reference.keys() == ({"target", "draft"} if arch == "mimo" else {"target"})
    for role in reference:
        assert served[role].keys() == reference[role].keys()
        differ = [n for n in reference[role] if not torch.equal(served[role][n], reference[role][n])]
        assert not differ, f"{role}: {differ}"
    # the push changed what is served (the two checkpoints differ)
    assert not torch.equal(served["target"]["model.embed_tokens.weight"], out["old"]["model.embed_tokens.weight"])
