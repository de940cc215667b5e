"""A server assembled from SGLang 0.5.23's own code, on CPU: the reference the embedded engine's weight routes are
tested against.

Run as `python -m tests.conformance.sglang_server <SGLang server flags>` (`--device cpu --dtype float32
--skip-server-warmup`; MiMo also `--trust-remote-code` and its EAGLE flags). SGLang's `http_server.launch_server`
runs unchanged (HTTP routes, TokenizerManager, DetokenizerManager), with this module's scheduler process plugged in
through SGLang's `run_scheduler_process_func`. That scheduler process runs SGLang's code for every weight request:
- `SchedulerWeightUpdaterManager` (session rules, selectors, fan-out, version record, flush, reply structs);
- `TpModelWorker`'s and the spec worker's weight methods (`init_weights_update_group`, `deserialize_own_rank`,
  `get_weights_by_name`, `weight_update_runners`), bound to a worker that holds only a model runner;
- per runner, the model-runner `WeightUpdater` (`init_custom_process_group`, `receive_weights_from_distributed`,
  `load_weights_from_distributed`, `update_weights_from_tensor`), `WeightExporter` and `ModelRunner.check_weights`
  (`WeightChecker`);
- the models: `MiMoForCausalLM` with its `MiMoMTP` draft (sharing the target's embedding and lm_head, as the EAGLE
  worker's `init_lm_head` does), or `LlamaForCausalLM`, built and loaded with their own `load_weights`
  (tests/conformance/sglang_models.py).

Test doubles: the scheduling of generation (nothing generates here: a generate request is answered as aborted),
the other control requests (flush, pause, continue, version, internal state: answered as SGLang's scheduler answers
them when idle), the process groups (one-rank gloo, as sglang_models.py), `vllm` (absent). After every
`/end_weight_update` the process writes every parameter and buffer of each runner (SGLang's names and values) to
the file named by SLIME_SPEC_SGLANG_STATE_OUT, so a test compares what landed by value.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from pathlib import Path

from slime_spec.engine.model_executor import hf_configs
from tests.conformance import sglang_doubles

sglang_doubles.install()
sys.meta_path.insert(0, sglang_doubles.AbsentModuleFinder({"vllm"}))
hf_configs.register()

logger = logging.getLogger("tests.conformance.sglang_server")
STATE_OUT = "SLIME_SPEC_SGLANG_STATE_OUT"


def _parallel_state(server_args) -> None:
    """SGLang's one-rank parallel groups (gloo), as its scheduler process builds them on one GPU."""
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.runtime_context import SpawnRanks, publish

    from slime_spec.common.net import free_port
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    initialize_model_parallel()
    initialize_dp_attention(server_args=server_args)


def _models(server_args) -> dict:
    """role -> SGLang's model for that runner, loaded from the checkpoint with its own load_weights."""
    import json

    import torch
    from safetensors.torch import load_file
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.mimo import MiMoForCausalLM
    from sglang.srt.models.mimo_mtp import MiMoMTP

    from tests.conformance.sglang_models import _build, _hf_config

    path = Path(server_args.model_path)
    config = json.loads((path / "config.json").read_text())
    arch = {"MiMoForCausalLM": "mimo", "LlamaForCausalLM": "llama"}[config["architectures"][0]]
    dtype = getattr(torch, server_args.dtype)
    weights = [item for f in sorted(path.glob("*.safetensors")) for item in load_file(str(f)).items()]
    models = {"target": _build({"mimo": MiMoForCausalLM, "llama": LlamaForCausalLM}[arch],
                               _hf_config(arch, config), dtype)}
    models["target"].load_weights(weights)
    if arch == "mimo" and server_args.speculative_algorithm:
        draft = _build(MiMoMTP, _hf_config("mimo", config), dtype)
        draft.load_weights(weights)
        draft.set_embed_and_head(*models["target"].get_embed_and_head())
        models["draft"] = draft
    return models


def _runner(model, model_path: str):
    """A ModelRunner holding only what weight requests touch: SGLang's WeightUpdater, WeightExporter and
    WeightChecker over `model`, and its own `check_weights`."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.model_runner_components.weight_exporter import WeightExporter
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.utils.weight_checker import WeightChecker

    runner = types.SimpleNamespace(model=model)
    runner.weight_updater = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None,
                                          custom_weight_loaders={}, get_model=lambda: model,
                                          update_model_fields=lambda *a, **k: None, recapture_cuda_graph=lambda: None,
                                          get_model_runner=lambda: runner)
    runner.weight_exporter = WeightExporter(tp_rank=0, tp_size=1, gpu_id=0, get_model_path=lambda: model_path,
                                            get_model=lambda: model)
    runner._weight_checker = WeightChecker(get_model=lambda: model)
    runner.check_weights = types.MethodType(ModelRunner.check_weights, runner)
    return runner


def _bind(obj, cls, *names):
    for name in names:
        setattr(obj, name, types.MethodType(getattr(cls, name), obj))
    return obj


class AssembledScheduler:
    """SGLang's weight manager over SGLang's model classes, behind SGLang's ZMQ channels."""

    def __init__(self, server_args, port_args):
        import zmq
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.managers.tp_worker import TpModelWorker
        from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
        from sglang.srt.utils.network import get_zmq_socket

        _parallel_state(server_args)
        self.runners = {role: _runner(model, server_args.model_path)
                        for role, model in _models(server_args).items()}
        target = self.runners["target"]
        tp_worker = _bind(types.SimpleNamespace(model_runner=target, _model_runner=target), TpModelWorker,
                          "weight_update_runners", "init_weights_update_group", "destroy_weights_update_group",
                          "deserialize_own_rank", "get_weights_by_name")
        draft_worker = None
        if "draft" in self.runners:
            draft_worker = _bind(types.SimpleNamespace(draft_worker=types.SimpleNamespace(
                draft_runners=[self.runners["draft"]])), BaseSpecWorker, "weight_update_runners")
        self.weight_version = server_args.weight_version
        self.manager = SchedulerWeightUpdaterManager(
            tp_worker=tp_worker, draft_worker=draft_worker, memory_saver_adapter=None,
            flush_cache=lambda **_: True, is_fully_idle=lambda **_: True, scheduler=self)
        context = zmq.Context(2)
        self.recv = get_zmq_socket(context, zmq.PULL, port_args.scheduler_input_ipc_name, False)
        self.to_tokenizer = get_zmq_socket(context, zmq.PUSH, port_args.tokenizer_ipc_name, False)

    def record_weight_version_change(self, new_version) -> None:
        if new_version is not None:
            self.weight_version = new_version

    def dump_state(self) -> None:
        import torch

        out = os.environ.get(STATE_OUT)
        if out:
            torch.save({role: {n: t.detach().clone() for n, t in [*r.model.named_parameters(),
                                                                   *r.model.named_buffers()]}
                        for role, r in self.runners.items()}, out)

    def answer(self, msg):
        """The reply SGLang's scheduler sends for `msg`, or None where it sends none."""
        from sglang.srt.managers import io_struct as io

        kind = type(msg).__name__
        methods = {"BeginWeightUpdateReqInput": "begin_weight_update", "EndWeightUpdateReqInput": "end_weight_update",
                   "InitWeightsUpdateGroupReqInput": "init_weights_update_group",
                   "DestroyWeightsUpdateGroupReqInput": "destroy_weights_update_group",
                   "UpdateWeightsFromDistributedReqInput": "update_weights_from_distributed",
                   "UpdateWeightsFromTensorReqInput": "update_weights_from_tensor",
                   "CheckWeightsReqInput": "check_weights", "GetWeightsByNameReqInput": "get_weights_by_name"}
        if kind in methods:
            out = getattr(self.manager, methods[kind])(msg)
            if kind == "EndWeightUpdateReqInput" and out.success:
                self.dump_state()
            return out
        if isinstance(msg, (io.TokenizedGenerateReqInput, io.BatchTokenizedGenerateReqInput)):
            reqs = msg.batch if isinstance(msg, io.BatchTokenizedGenerateReqInput) else [msg]
            for req in reqs:
                message = "this server does not generate"
                self.send(io.AbortReq(rid=req.rid, http_worker_ipc=req.http_worker_ipc, abort_message=message,
                                      finished_reason={"type": "abort", "message": message, "status_code": 503}))
            return None
        if kind == "FlushCacheReqInput":
            return io.FlushCacheReqOutput(success=True)
        if kind == "UpdateWeightVersionReqInput":
            self.weight_version = msg.new_version
            return io.UpdateWeightVersionReqOutput()
        if kind == "GetInternalStateReq":
            return io.GetInternalStateReqOutput(internal_state={"world_size": 1})
        if kind not in ("PauseGenerationReqInput", "ContinueGenerationReqInput", "AbortReq", "FreezeGCReq",
                        "ConfigureLoggingReq"):
            logger.warning("%s is not answered by this server", kind)
        return None

    def send(self, obj) -> None:
        from sglang.srt.managers.io_struct import sock_send

        sock_send(self.to_tokenizer, obj)

    def serve(self) -> None:
        from sglang.srt.managers.io_struct import ShutdownReq, sock_recv

        while True:
            msg = sock_recv(self.recv)
            if isinstance(msg, ShutdownReq):
                return
            reply = self.answer(msg)
            if reply is not None:
                reply.http_worker_ipc = getattr(msg, "http_worker_ipc", None)
                self.send(reply)


def run_scheduler_process(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer):
    """SGLang's `run_scheduler_process_func`: SGLang's ready handshake, then serve until ShutdownReq."""
    from sglang.srt.model_executor.graph_memory_usage import empty_graph_time_usage
    from sglang.srt.utils.common import kill_itself_when_parent_died

    kill_itself_when_parent_died()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s")
    try:
        scheduler = AssembledScheduler(server_args, port_args)
    except Exception as e:
        logger.exception("the assembled scheduler did not start")
        pipe_writer.send({"status": "error", "message": str(e)})
        os._exit(1)
    pipe_writer.send({"status": "ready", "max_req_input_len": 255, "max_total_num_tokens": 4096,
                      "startup_time": {"load_weight": 0.0, "kv_cache_allocation": 0.0, "scheduler_e2e": 0.0,
                                       "cuda_graph": empty_graph_time_usage()}})
    scheduler.serve()


def run_detokenizer_process(*args, **kwargs):
    """SGLang's DetokenizerManager process, unchanged; started through this module so that its spawned child
    installs the import doubles first."""
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process as run

    return run(*args, **kwargs)


def main(argv: list[str]) -> int:
    from sglang.srt.entrypoints import http_server
    from sglang.srt.server_args import prepare_server_args

    http_server.launch_server(prepare_server_args(argv), run_scheduler_process_func=run_scheduler_process,
                              run_detokenizer_process_func=run_detokenizer_process)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
