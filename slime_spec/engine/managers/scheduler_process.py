"""The embedded engine as SGLang's scheduler process: SGLang's front end in front, our EngineCore behind.

SGLang's launcher (`http_server.launch_server(..., run_scheduler_process_func=...)`) spawns this process in place
of its own Scheduler. Like SGLang's, it connects (never binds) to the ZMQ channels of `PortArgs`:
- `scheduler_input_ipc_name` (PULL): tokenized requests and control requests from the TokenizerManager;
- `detokenizer_ipc_name` (PUSH): `BatchTokenIDOutput`s to SGLang's DetokenizerManager, one per engine-loop pass
  that finished or streamed a request (engine/managers/output_stream.py);
- `tokenizer_ipc_name` (PUSH): the `...Output` reply of every control request that awaits one, refusals
  (`AbortReq` with a status) and health acknowledgements.
Messages go through SGLang's own `io_struct.sock_send` / `sock_recv`.

The engine runs on its own thread (`scheduler.EngineLoop`, the only thread that touches EngineCore); this
process's main thread receives messages and posts them there. Replies are sent from whichever thread finishes the
work, under one lock (ZMQ sockets are not thread-safe). Weight routes run through SGLang's own
SchedulerWeightUpdaterManager over our runners (`weight_updater.EngineWeights`).

On CUDA SGLang starts its children with `spawn`, and a child imports the module of its target function before
anything else: importing this module installs what SGLang's imports need on this machine (sglang_stand_ins,
hf_configs), so both processes SGLang spawns here (this scheduler, and its DetokenizerManager through
`run_detokenizer_process`) import SGLang safely. On CPU they are forked from the launcher, which installed them
already (`slime_spec.engine.__main__.fork_children_on_cpu`).
"""

from __future__ import annotations

from slime_spec.engine import sglang_stand_ins
from slime_spec.engine.model_executor import hf_configs

sglang_stand_ins.install()
hf_configs.register()

import functools
import gc
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

logger = logging.getLogger("slime_spec.engine.managers.scheduler")

SCHEDULER_TITLE = "sglang::scheduler"  # SGLang's own scheduler's title: tools that list SGLang's processes find it


def freeze_gc(gc_threshold: tuple[int, ...] | None = None) -> int:
    """SGLang's `freeze_gc`: set `--gc-threshold` if given, then move every object alive now (the model, the
    tokenizer) into the collector's permanent generation, so generation-2 passes stop scanning them (a pass over
    this process's heap held the GIL for about 0.3 s mid-rollout on the demo's CPU engine). Returns the count."""
    if gc_threshold is not None:
        gc.set_threshold(*gc_threshold)
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def make_core_factory(args) -> Callable[[], Any]:
    """EngineServerArgs -> a function that builds the EngineCore (on the engine thread)."""
    def make_core():
        import torch

        from slime_spec.engine.managers.engine_core import EngineCore
        torch.manual_seed(args.random_seed)
        return EngineCore(args.model_path, args.spec, dtype=args.dtype, device=args.device,
                          max_running_requests=args.max_running_requests, context_length=args.context_length,
                          seed=args.random_seed, draft_sampling=args.spec_draft_sampling, spec_auto=args.spec_auto,
                          cuda_graph=args.cuda_graph, overlap_schedule=args.overlap_schedule,
                          kernels=args.kernels, memory_saver=args.memory_saver)
    return make_core


class EmbeddedScheduler:
    """One engine behind SGLang's ZMQ channels (see the module docstring)."""

    def __init__(self, engine_args, server_args, port_args):
        import zmq
        from sglang.srt.utils.network import get_zmq_socket

        from slime_spec.engine.managers.output_stream import OutputStream
        from slime_spec.engine.managers.scheduler import EngineLoop
        from slime_spec.engine.weights.updater import EngineWeights
        self.args, self.server_args = engine_args, server_args
        self.spec_enabled = engine_args.spec is not None
        self._context = zmq.Context(2)
        self._recv = get_zmq_socket(self._context, zmq.PULL, port_args.scheduler_input_ipc_name, False)
        # As SGLang's scheduler: with --skip-tokenizer-init there is no decode work, outputs go straight back
        outputs_to = port_args.tokenizer_ipc_name if server_args.skip_tokenizer_init else port_args.detokenizer_ipc_name
        self._to_detokenizer = get_zmq_socket(self._context, zmq.PUSH, outputs_to, False)
        self._to_tokenizer = get_zmq_socket(self._context, zmq.PUSH, port_args.tokenizer_ipc_name, False)
        self._send_lock = threading.Lock()
        self._inflight: dict[str, Any] = {}  # rid -> its TokenizedGenerateReqInput, until its output is sent
        self.outputs = OutputStream(functools.partial(self._send, self._to_detokenizer), self.spec_enabled,
                                    server_args.stream_interval)
        t0 = time.perf_counter()
        self.loop = EngineLoop(make_core_factory(engine_args), after_pass=lambda: self.outputs.flush(self.loop))
        self.loop.start()  # raises the engine's construction error
        self.load_seconds = time.perf_counter() - t0
        self.weights = EngineWeights(self.loop.core, server_args.weight_version, engine_args.device)
        self._warm_checksum_kernels()
        self.startup_time = time.time()
        self._handlers = self._control_handlers()

    def _warm_checksum_kernels(self) -> None:
        """SGLang's checksum kernels compiled before serving (weights/checker.py); a failure is logged, not fatal:
        the first /weights_checker then compiles them, or fails as it would have."""
        from slime_spec.engine.weights.checker import warm_checksum_kernels
        try:
            seconds = self.loop.call(lambda core: warm_checksum_kernels(core.device),
                                     label="compiling the checksum kernels").result()
        except Exception as e:
            logger.warning("SGLang's checksum kernels were not compiled at start (%s: %s); the first /weights_checker "
                           "compiles them", type(e).__name__, e)
            return
        if seconds:
            logger.info("SGLang's checksum kernels compiled in %.2f s", seconds)

    # ------------------------------------------------------------------ sending
    def _send(self, socket, obj) -> None:
        from sglang.srt.managers.io_struct import sock_send

        with self._send_lock:
            sock_send(socket, obj)

    def reply(self, obj) -> None:
        self._send(self._to_tokenizer, obj)

    def handshake(self) -> dict:
        """What SGLang's launcher waits for on the pipe (merged into /server_info)."""
        from sglang.srt.model_executor.graph_memory_usage import empty_graph_time_usage

        core = self.loop.core
        graphs = empty_graph_time_usage()  # seconds per capture phase; ours are decode-time graphs
        if "decode" in graphs:
            graphs["decode"] = core.graph_capture_seconds
        return {"status": "ready", "max_req_input_len": core.finish_rules.max_req_input_len,
                "max_total_num_tokens": core.max_running_requests * core.context_length,
                "startup_time": {"load_weight": self.load_seconds, "kv_cache_allocation": 0.0,
                                 "scheduler_e2e": self.load_seconds, "cuda_graph": graphs}}

    # ------------------------------------------------------------------ the receive loop
    def serve(self) -> None:
        from sglang.srt.managers.io_struct import ShutdownReq, sock_recv

        while True:
            msg = sock_recv(self._recv)
            if isinstance(msg, ShutdownReq):
                logger.info("shutdown requested")
                return
            try:
                self.dispatch(msg)
            except Exception:  # one bad message must not take the engine down; it is logged with its type
                logger.exception("handling %s failed", type(msg).__name__)

    def dispatch(self, msg) -> None:
        from sglang.srt.managers.io_struct import BatchTokenizedGenerateReqInput, TokenizedGenerateReqInput

        if isinstance(msg, TokenizedGenerateReqInput):
            self.generate(msg)
        elif isinstance(msg, BatchTokenizedGenerateReqInput):
            for req in msg.batch:
                self.generate(req)
        else:
            handler = self._handlers.get(type(msg).__name__)
            if handler is None:
                logger.warning("%s is not handled by the embedded engine; ignored", type(msg).__name__)
                return
            handler(msg)

    # ------------------------------------------------------------------ generation
    def generate(self, req) -> None:
        from sglang.srt.managers.io_struct import HealthCheckOutput
        from sglang.srt.managers.utils import is_health_check_generate_req

        from slime_spec.engine.managers.io_struct import (
            UnsupportedRequest,
            prompt_length_error,
            rejection,
            to_core_request,
        )
        core = self.loop.core
        if is_health_check_generate_req(req) and (core.has_work() or self.loop.load()["num_waiting_reqs"]):
            # As SGLang's scheduler: a busy engine answers the probe at once instead of queueing it.
            self.reply(HealthCheckOutput(http_worker_ipc=req.http_worker_ipc))
            return
        try:
            request = to_core_request(req, core.context_length)
        except UnsupportedRequest as e:
            self.reply(rejection(req.rid, str(e), req.http_worker_ipc))
            return
        too_long = prompt_length_error(request.input_ids, core.finish_rules.max_req_input_len)
        if too_long is not None:
            self.reply(rejection(req.rid, too_long, req.http_worker_ipc))
            return
        self._inflight[req.rid] = req
        self.outputs.add_stream(req)
        self.loop.generate(request, on_done=functools.partial(self._finished, req))

    def _finished(self, req, fut: Future) -> None:
        """Engine thread: the output goes out with the rest of the pass's (engine/managers/output_stream.py); an error
        at once."""
        from slime_spec.engine.managers.io_struct import rejection
        from slime_spec.engine.managers.scheduler import Unavailable
        self._inflight.pop(req.rid, None)
        error = fut.exception()
        if error is None:
            self.outputs.finished(req, fut.result())
            return
        self.outputs.forget(req.rid)
        status = 503 if isinstance(error, Unavailable) else 400 if isinstance(error, ValueError) else 500
        self.reply(rejection(req.rid, str(error), req.http_worker_ipc, status))

    # ------------------------------------------------------------------ control requests
    def _on_engine(self, fn: Callable[[Any], Any], reply: Callable[[Any], Any] | None = None,
                   needs_idle: bool = False, label: str = "a call") -> None:
        """Run fn(core) on the engine thread; when `reply` is given, send reply(the finished future) to the
        tokenizer (reply builds SGLang's answer from the result or the error); else log an error."""
        fut = self.loop.call(fn, needs_idle=needs_idle, label=label)
        if reply is None:
            fut.add_done_callback(lambda f: f.exception() and logger.error("%s failed: %r", label, f.exception()))
            return

        def done(f: Future) -> None:
            self.reply(reply(f))
        fut.add_done_callback(done)

    def _control_handlers(self) -> dict[str, Callable[[Any], None]]:
        from sglang.srt.managers import io_struct as io

        from slime_spec.engine.weights.updater import MANAGER_METHODS, WHILE_IDLE, failure_reply
        w = self.weights

        def weight_request(msg):
            """SGLang's SchedulerWeightUpdaterManager answers, on the engine thread (engine/weights/updater.py)."""
            kind = type(msg).__name__
            self._on_engine(lambda core: w.handle(msg),
                            lambda f: _with_ipc(f.result() if f.exception() is None
                                                else failure_reply(msg, f"{f.exception()}"), msg.http_worker_ipc),
                            needs_idle=kind in WHILE_IDLE, label=MANAGER_METHODS[kind])

        def flush(msg):
            self._on_engine(lambda core: core.flush_cache(),
                            lambda f: _with_ipc(io.FlushCacheReqOutput(success=not f.exception() and f.result()),
                                                msg.http_worker_ipc), label="/flush_cache")

        def abort(msg):
            """SGLang's scheduler aborts every request whose rid starts with the given one (parallel samples
            `rid_k` included); a running request ends at the next step, so while paused in place, after continue."""
            message = msg.abort_message or "Abort request"
            if msg.abort_all:
                self._on_engine(lambda core: self.loop.abort(None, message), label="/abort_request")
            elif msg.rid:
                self._on_engine(lambda core: self.loop.abort_many(
                    [rid for rid in list(self._inflight) if rid.startswith(msg.rid)], message), label="/abort_request")

        def pause(msg):
            self._on_engine(lambda core: self.loop.pause(msg.mode), label="/pause_generation")

        def resume(msg):
            self._on_engine(lambda core: self.loop.resume(), label="/continue_generation")

        def update_weight_version(msg):
            def update(core):
                w.weight_version = msg.new_version
            self._on_engine(update, lambda f: io.UpdateWeightVersionReqOutput(http_worker_ipc=msg.http_worker_ipc),
                            label="/update_weight_version")

        def internal_state(msg):
            self._on_engine(lambda core: self.internal_state(),
                            lambda f: io.GetInternalStateReqOutput(internal_state=f.result() if not f.exception()
                                                                   else {"error": repr(f.exception())},
                                                                   http_worker_ipc=msg.http_worker_ipc),
                            label="/server_info")

        def release(msg):
            self._on_engine(lambda core: core.release_memory(msg.tags),
                            lambda f: io.ReleaseMemoryOccupationReqOutput(http_worker_ipc=msg.http_worker_ipc),
                            label="/release_memory_occupation")

        def resume_memory(msg):
            self._on_engine(lambda core: core.resume_memory(msg.tags),
                            lambda f: io.ResumeMemoryOccupationReqOutput(http_worker_ipc=msg.http_worker_ipc),
                            label="/resume_memory_occupation")

        def freeze(msg):  # as SGLang's scheduler: freeze here, then forward to the detokenizer
            frozen = freeze_gc(self.args.gc_threshold)
            logger.debug("froze the collector: %d objects in the permanent generation", frozen)
            self._send(self._to_detokenizer, msg)

        handlers = {
            "FlushCacheReqInput": flush, "AbortReq": abort, "PauseGenerationReqInput": pause,
            "ContinueGenerationReqInput": resume, "UpdateWeightVersionReqInput": update_weight_version,
            "GetInternalStateReq": internal_state,
            "ReleaseMemoryOccupationReqInput": release, "ResumeMemoryOccupationReqInput": resume_memory,
            "FreezeGCReq": freeze, "ConfigureLoggingReq": lambda msg: None,
        }
        handlers.update({kind: weight_request for kind in MANAGER_METHODS})
        handlers.update(self._corpus_handlers())
        return handlers

    def _corpus_handlers(self) -> dict[str, Callable[[Any], None]]:
        """NGRAM external corpora (SGLang's routes; SGLang's TokenizerManager has tokenized the documents)."""
        from sglang.srt.managers import io_struct as io

        from slime_spec.engine.drafters.history import SEPARATOR
        off = "Ngram speculative decoding is not enabled."  # SGLang's scheduler's answer

        def corpora(core):
            return core.drafter if core.drafter is not None and core.drafter.holds_corpora else None

        def add(msg):
            def load(core):
                drafter = corpora(core)
                if drafter is None:
                    return io.AddExternalCorpusReqOutput(success=False, message=off)
                chunks = [c if i == 0 else [SEPARATOR, *c] for i, c in enumerate(msg.token_chunks or [])]
                try:
                    loaded = drafter.add_corpus(msg.corpus_id, chunks)
                except ValueError as e:
                    return io.AddExternalCorpusReqOutput(success=False, message=str(e))
                return io.AddExternalCorpusReqOutput(success=True, corpus_id=msg.corpus_id, loaded_token_count=loaded,
                                                     message=f"Loaded corpus '{msg.corpus_id}' with {loaded} tokens.")
            self._on_engine(load, lambda f: _with_ipc(f.result(), msg.http_worker_ipc), label="/add_external_corpus")

        def remove(msg):
            def drop(core):
                drafter = corpora(core)
                if drafter is None:
                    return io.RemoveExternalCorpusReqOutput(success=False, message=off)
                drafter.remove_corpus(msg.corpus_id)
                return io.RemoveExternalCorpusReqOutput(success=True, message=f"Removed corpus '{msg.corpus_id}'.")
            self._on_engine(drop, lambda f: _with_ipc(f.result(), msg.http_worker_ipc),
                            label="/remove_external_corpus")

        def listing(msg):
            def counts(core):
                drafter = corpora(core)
                if drafter is None:
                    return io.ListExternalCorporaReqOutput(success=False, message=off)
                return io.ListExternalCorporaReqOutput(success=True, corpus_token_counts=drafter.list_corpora())
            self._on_engine(counts, lambda f: _with_ipc(f.result(), msg.http_worker_ipc),
                            label="/list_external_corpora")

        return {"AddExternalCorpusReqInput": add, "RemoveExternalCorpusReqInput": remove,
                "ListExternalCorporaReqInput": listing}

    def internal_state(self) -> dict:
        """SGLang's scheduler's internal state (resolved server args, topology, speculative accept length), plus
        ours: `engine_step_s` (seconds inside engine steps since start), `spec_step_times` (per phase),
        and the load counts."""
        from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

        loop = self.loop
        state = msgspec_to_builtins(self.server_args.resolved_dict())
        state.update({"world_size": 1, "startup_time": self.startup_time,
                      "effective_max_running_requests_per_dp": self.args.max_running_requests,
                      "last_gen_throughput": loop.stats["last_gen_throughput"], **loop.load(),
                      "engine_step_s": loop.stats["engine_step_s"]})
        if self.spec_enabled:
            state["avg_spec_accept_length"] = loop.stats["avg_spec_accept_length"]
            state["spec_step_times"] = loop.core.step_times.as_dict()
        return state

    def close(self) -> None:
        self.loop.stop()
        self._context.destroy(linger=0)


def _with_ipc(obj, http_worker_ipc):
    obj.http_worker_ipc = http_worker_ipc
    return obj


def run_scheduler_process(engine_args, server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer):
    """SGLang's `run_scheduler_process_func` signature, with our EngineServerArgs bound first (functools.partial).

    Sends SGLang's ready handshake on `pipe_writer`, then serves until ShutdownReq; a start-up error is printed and
    exits non-zero (SGLang's launcher then stops the server)."""
    from sglang.srt.utils.common import kill_itself_when_parent_died

    kill_itself_when_parent_died()
    import setproctitle

    setproctitle.setproctitle(SCHEDULER_TITLE)
    logging.basicConfig(level=engine_args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    try:
        scheduler = EmbeddedScheduler(engine_args, server_args, port_args)
    except Exception as e:
        print(f"error: the embedded engine did not start: {e}", file=sys.stderr, flush=True)
        pipe_writer.send({"status": "error", "message": str(e)})
        os._exit(1)
    frozen = freeze_gc(engine_args.gc_threshold)  # as SGLang does once its server is warm
    logger.info("engine ready (device %s, dtype %s, speculative %s); collector frozen (%d objects)",
                engine_args.device, engine_args.dtype, engine_args.spec, frozen)
    pipe_writer.send(scheduler.handshake())
    try:
        scheduler.serve()
    finally:
        scheduler.close()


def run_detokenizer_process(*args, **kwargs):
    """SGLang's DetokenizerManager process, unchanged; started through this module so that its spawned child
    installs the stand-ins first (see the module docstring)."""
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process as run

    return run(*args, **kwargs)
