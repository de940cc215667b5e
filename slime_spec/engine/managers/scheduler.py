"""The engine thread (SGLang's scheduler event loop): the only thread that touches EngineCore.

The scheduler process (engine/managers/scheduler_process.py, which receives SGLang's requests) never calls the engine;
it posts
work here and is answered through a concurrent Future, resolved on this thread:
- `generate(request, on_done)`: admitted into the engine at the next iteration unless generation is paused
  or a weight update is waiting for the engine to drain;
- `call(fn)`: runs `fn(core)` between two steps (info, aborts, pause/continue);
- `call(fn, needs_idle=True)`: SGLang runs weight updates under a writer lock that waits for every
  in-flight request to finish (or at once if generation is paused); same here: requests already
  running finish on the old weights, requests arriving meanwhile wait, then `fn` runs.

After every pass of the loop (a step, or the calls it ran), before it may block, `after_pass()` runs on this
thread: there the scheduler process sends what the pass finished, and `progress()` of the requests it streams, in
one message, as SGLang's scheduler sends one per step.

The loop records which operation (a step, or a call such as a weight update) it is inside and since when
(`busy`). While memory is released
(/release_memory_occupation) a /generate is refused with `Unavailable` (503) at admission instead of
waiting for a resume nobody may send; the loop blocks on its inbox whenever it cannot progress, never spins.

Pause modes (SGLang's PauseGenerationReqInput): "abort" aborts everything in flight and pauses;
"in_place" stops stepping with requests kept (a flush is refused while they hold KV); "retract" stops
stepping and moves running requests back to waiting: they are re-prefilled, on whatever weights are
then served, after continue_generation (prompt + tokens so far, the rest of the budget).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Container

logger = logging.getLogger(__name__)


class Unavailable(Exception):
    """The engine cannot serve this now (memory released); answered 503 with the message."""


@dataclass
class _Generate:
    request: Any  # slime_spec.engine.managers.engine_core.Request
    future: Future


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: Future
    needs_idle: bool = False
    label: str = "a call"


@dataclass
class _Retracted:
    """Tokens a retracted request produced before retraction, merged into its final Output."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    verify_ct: int = 0
    accept_num: int = 0
    draft_num: int = 0
    prompt_tokens: int = 0


class EngineLoop:
    def __init__(self, make_core: Callable[[], Any], clock: Callable[[], float] = time.monotonic,
                 after_pass: Callable[[], None] | None = None):
        """clock: the time source of `busy` (tests pass a fake one to simulate a stuck operation); after_pass: see
        the module docstring."""
        self._make_core = make_core
        self._clock = clock
        self._after_pass = after_pass
        self.busy: tuple[str, float] | None = None  # (operation, since) while the engine thread is inside one
        self.iterations = 0  # loop passes: constant while idle (the loop blocks on its inbox; tests read it)
        self._inbox: queue.Queue = queue.Queue()
        self._pending: deque[_Generate] = deque()     # received, not yet admitted
        self._idle_calls: deque[_Call] = deque()      # waiting for the engine to drain
        self._futures: dict[str, Future] = {}          # rid -> future, for requests inside the engine
        self._requests: dict[str, Any] = {}            # rid -> Request, for retraction
        self._retracted: dict[str, _Retracted] = {}
        self._ready = threading.Event()
        self._stop = False
        self.startup_error: BaseException | None = None
        self.core: Any = None
        self.paused = False
        self.stats = {"avg_spec_accept_length": 1.0, "last_gen_throughput": 0.0, "engine_step_s": 0.0}
        self._window_tokens = 0
        self._window_start = time.perf_counter()
        self._broken: str | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Build the engine on its thread; raise its construction error here, so a bad start fails at once."""
        self._thread.start()
        self._ready.wait()
        if self.startup_error is not None:
            raise self.startup_error

    def generation_blocked(self) -> str | None:
        """Why a /generate sent now would not run until someone acts (paused, or memory released), else None."""
        if self.core is not None and self.core.released_tags:
            return (f"memory is released (/release_memory_occupation, tags {self.core.released_tags}); call "
                    "/resume_memory_occupation before generating")
        if self.paused:
            return "generation is paused (/pause_generation); call /continue_generation"
        return None

    def load(self) -> dict:
        """SGLang's LoadSnapshot counts: requests inside the engine, and received but not admitted."""
        return {"num_running_reqs": len(self._futures), "num_waiting_reqs": len(self._pending)}

    def stop(self) -> None:
        self._stop = True
        self._inbox.put(None)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ API for HTTP handlers
    def generate(self, request: Any, on_done: Callable[[Future], Any] | None = None) -> Future:
        """on_done(future) runs on the engine thread when the request ends (attached before the request is posted,
        so it never runs on the caller's thread)."""
        fut: Future = Future()
        if on_done is not None:
            fut.add_done_callback(on_done)
        self._inbox.put(_Generate(request, fut))
        return fut

    def call(self, fn: Callable[[Any], Any], needs_idle: bool = False, label: str = "a call") -> Future:
        """label names the operation in /health's message while it runs (e.g. the route)."""
        fut: Future = Future()
        self._inbox.put(_Call(fn, fut, needs_idle, label))
        return fut

    # ------------------------------------------------------------------ engine-thread operations
    def abort(self, rid: str | None, message: str = "Abort request") -> None:
        """Abort one request (or all with rid None), wherever it is: pending, retracted, or in the engine."""
        self.abort_many(None if rid is None else [rid], message)

    def abort_many(self, rids: list[str] | None, message: str = "Abort request") -> None:
        """Abort these requests (all with None) in one pass over the pending queue: linear in its length."""
        wanted = None if rids is None else set(rids)
        if any(wanted is None or item.request.rid in wanted for item in self._pending):
            keep: deque[_Generate] = deque()
            for item in self._pending:
                if wanted is None or item.request.rid in wanted:
                    self._finish_unadmitted(item, message)
                else:
                    keep.append(item)
            self._pending = keep
        if wanted is None:
            self.core.abort_all()
        else:
            for rid in wanted:
                self.core.abort(rid)

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(None, "Abort on pause_generation")
            self._deliver(self.core.step())  # every row is finished: this step only collects them
        elif mode == "retract":
            self._retract_running()
        elif mode != "in_place":
            raise ValueError(f"mode={mode!r}: expected 'abort', 'retract' or 'in_place'")
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def progress(self, rids: Container[str]) -> list:
        """Engine thread: what each running request among `rids` has produced so far (tokens before a retraction
        included), as Outputs whose finish_reason is None. A request not yet admitted, or finished in the last step
        (its Output is delivered through its future), is left out."""
        from slime_spec.engine.managers.engine_core import Output
        outs = []
        for row in self.core.running:
            rid = row.req.rid
            if row.finish is not None or rid not in rids:
                continue
            prev = self._retracted.get(rid)
            ids = row.output_ids
            logprobs = list(row.logprobs) if row.req.return_logprob else None
            verify, accept, draft, prompt = row.verify_ct, row.accept_num, row.draft_num, row.prompt_len
            if prev is not None:
                ids = prev.output_ids + ids
                logprobs = None if logprobs is None else prev.logprobs + logprobs
                verify, accept, draft = verify + prev.verify_ct, accept + prev.accept_num, draft + prev.draft_num
                prompt = prev.prompt_tokens
            outs.append(Output(rid=rid, output_ids=ids, output_logprobs=logprobs, finish_reason=None,
                               prompt_tokens=prompt, completion_tokens=len(ids), spec_verify_ct=verify,
                               spec_accept_token_num=accept, spec_draft_token_num=draft, text=""))
        return outs

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            self.core = self._make_core()
        except BaseException as e:  # reported by start() in the main thread
            self.startup_error = e
            self._ready.set()
            return
        self._ready.set()
        while not self._stop:
            self.iterations += 1
            self._pass()
            if self._after_pass is not None:
                try:
                    self._after_pass()
                except Exception:  # the engine keeps serving the other requests; these get no answer
                    logger.exception("sending this pass's outputs failed; the requests in it get no answer")

    def _pass(self) -> None:
        self._drain(block=not self._can_progress())
        if self._stop:
            return
        if not self.paused and not self._idle_calls:
            self._admit()
        if self._idle_calls and (self.paused or not self.core.has_work()):
            self._run_call(self._idle_calls.popleft())
            return
        if not self.paused and self.core.has_work():
            self._step()

    def _can_progress(self) -> bool:
        """False means: block on the inbox (nothing to do until a message arrives), never spin."""
        if self.paused:
            return bool(self._idle_calls)
        return self.core.has_work() or bool(self._idle_calls) or bool(self._pending)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get() if block else self._inbox.get_nowait()  # stop() wakes it
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            if isinstance(item, _Generate):
                self._pending.append(item)
            elif item.needs_idle:
                self._idle_calls.append(item)
            else:
                self._run_call(item)

    def _run_call(self, call: _Call) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        self.busy = (call.label, self._clock())
        try:
            call.future.set_result(call.fn(self.core))
        except Exception as e:  # handed to the HTTP handler, which answers 400 with the message
            call.future.set_exception(e)
        finally:
            self.busy = None

    def _admit(self) -> None:
        """O(1) per request: the rid check is a dict lookup here and in EngineCore.add_request."""
        while self._pending:
            item = self._pending.popleft()
            rid = item.request.rid
            if self.core.released_tags:
                item.future.set_exception(Unavailable(self.generation_blocked()))
                continue
            if rid in self._futures:
                item.future.set_exception(ValueError(f"request {rid}: a request with this rid is already running"))
                continue
            try:
                self.core.add_request(item.request)
            except ValueError as e:
                item.future.set_exception(e)
                continue
            self._futures[rid] = item.future
            self._requests[rid] = item.request

    def _step(self) -> None:
        t0 = time.perf_counter()
        self.busy = ("a generation step", self._clock())
        try:
            outputs = self.core.step()
        except Exception as e:  # an engine bug: fail the requests in flight, keep serving
            logger.exception("engine step failed; aborting the requests in flight")
            self._fail_in_flight(e)
            return
        finally:
            self.busy = None
        self._deliver(outputs)
        self._window_tokens += sum(o.completion_tokens for o in outputs)
        now = time.perf_counter()
        if now - self._window_start >= 1.0 and self._window_tokens:
            self.stats["last_gen_throughput"] = self._window_tokens / (now - self._window_start)
            self._window_tokens, self._window_start = 0, now
        elif not self.core.has_work():
            self._window_start = now - (now - t0)  # idle time does not dilute throughput
        self.stats["avg_spec_accept_length"] = float(self.core.avg_spec_accept_length)
        self.stats["engine_step_s"] += time.perf_counter() - t0  # the rollout's time outside it: HTTP, queues

    def _fail_in_flight(self, error: Exception) -> None:
        for fut in self._futures.values():
            fut.set_exception(RuntimeError(f"engine step failed: {error!r}"))
        self._futures.clear()
        self._requests.clear()
        self._retracted.clear()
        self.core.abort_all()
        try:
            self.core.step()  # every row is aborted: this only collects them
        except Exception:
            logger.exception("the engine cannot recover; /health now answers 503")
            self._broken = repr(error)
            self._stop = True

    def _deliver(self, outputs: list) -> None:
        for out in outputs:
            out = self._merge_retracted(out)
            fut = self._futures.pop(out.rid, None)
            self._requests.pop(out.rid, None)
            if fut is not None:
                fut.set_result(out)

    def _finish_unadmitted(self, item: _Generate, message: str) -> None:
        from slime_spec.engine.managers.engine_core import Output
        req = item.request
        out = Output(rid=req.rid, output_ids=[], output_logprobs=[] if req.return_logprob else None,
                     finish_reason={"type": "abort", "message": message}, prompt_tokens=len(req.input_ids),
                     completion_tokens=0, spec_verify_ct=0, spec_accept_token_num=0, spec_draft_token_num=0, text="")
        item.future.set_result(self._merge_retracted(out))

    # ------------------------------------------------------------------ retract
    def _retract_running(self) -> None:
        """Abort every request in the engine, keep what it produced, and queue its continuation."""
        self.core.abort_all()
        outputs = self.core.step()  # collects the aborted rows without computing
        for out in outputs:
            fut = self._futures.pop(out.rid, None)
            req = self._requests.pop(out.rid, None)
            if fut is None or req is None:
                continue
            prev = self._retracted.setdefault(out.rid, _Retracted(prompt_tokens=out.prompt_tokens))
            prev.output_ids += out.output_ids
            prev.logprobs += out.output_logprobs or []
            prev.verify_ct += out.spec_verify_ct
            prev.accept_num += out.spec_accept_token_num
            prev.draft_num += out.spec_draft_token_num
            req.input_ids = list(req.input_ids) + list(out.output_ids)
            req.params.max_new_tokens -= len(out.output_ids)
            self._pending.appendleft(_Generate(req, fut))

    def _merge_retracted(self, out: Any) -> Any:
        prev = self._retracted.pop(out.rid, None)
        if prev is None:
            return out
        from dataclasses import replace

        ids = prev.output_ids + list(out.output_ids)
        text = self.core.tokenizer.decode(prev.output_ids, skip_special_tokens=True) + out.text
        logprobs = None if out.output_logprobs is None else prev.logprobs + list(out.output_logprobs)
        finish = out.finish_reason
        if finish.get("type") == "length":
            finish = {"type": "length", "length": len(ids)}
        return replace(out, output_ids=ids, output_logprobs=logprobs, prompt_tokens=prev.prompt_tokens,
                       completion_tokens=len(ids), spec_verify_ct=prev.verify_ct + out.spec_verify_ct,
                       spec_accept_token_num=prev.accept_num + out.spec_accept_token_num,
                       spec_draft_token_num=prev.draft_num + out.spec_draft_token_num, text=text, finish_reason=finish)
