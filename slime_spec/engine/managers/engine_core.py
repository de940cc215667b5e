"""EngineCore: continuous batching over a static KV cache, with optional speculative decoding.

One `step()` admits waiting requests into free cache slots (one batched prefill), then runs one batched
decode pass (or draft + verify pass) over every running request, and returns the requests that finished.
Called from a single thread (the server's engine thread); nothing here locks.
"""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path

import torch

from slime_spec.common.dtypes import canonical_dtype
from slime_spec.common.threads import intra_op_threads
from slime_spec.engine.drafters import Drafter, HybridDrafter, MTPDrafter, make_drafter
from slime_spec.engine.kernels.ops import Kernels
from slime_spec.engine.kernels.sampling import sample_rows
from slime_spec.engine.managers import memory_occupation
from slime_spec.engine.managers.finish import FinishRules
from slime_spec.engine.managers.memory_occupation import MemoryOccupation
from slime_spec.engine.managers.overlap import OverlapDecode
from slime_spec.engine.managers.request import NAN_FINISH, Output, Request, Row, SamplingParams, eos_ids
from slime_spec.engine.model_executor import sampling
from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings
from slime_spec.engine.model_executor.model import CausalLM, load_model
from slime_spec.engine.model_executor.model_graphs import graph_model, prefill_graph
from slime_spec.engine.model_executor.transfer import device_tensor
from slime_spec.engine.speculative import SpecWorker, StepTimes, tree
from slime_spec.engine.speculative import policy as spec_policy
from slime_spec.engine.speculative.accept_graph import AcceptGraph
from slime_spec.engine.speculative.tree_graphs import capture_tree_graphs
from slime_spec.engine.weights import updater as weight_updater
from slime_spec.speculative.settings import SpecConfig, check_resolved
from slime_spec.weight_sync import fp8

__all__ = ["EngineCore", "Output", "Request", "SamplingParams", "SpecConfig"]


class EngineCore:
    nan_finish = NAN_FINISH

    def __init__(self, model_path: str, spec: SpecConfig | None, *, dtype: str = "float32", device: str = "cpu",
                 max_running_requests: int = 32, context_length: int | None = None, seed: int = 0,
                 cpu_threads: int | None = None, draft_sampling: bool = False, spec_auto: bool = False,
                 cuda_graph: CudaGraphSettings | None = None, overlap_schedule: bool | None = None,
                 kernels: Kernels | None = None, memory_saver: bool = False):
        """spec: resolved speculative settings (slime_spec.speculative.settings.resolve), None without speculation.
        cpu_threads: intra-op threads while stepping on CPU; None = 1 for small models (hidden <= 1024), where
        thread hand-off costs more than the tiny matmuls gain, else torch's default.
        draft_sampling (ours, --spec-draft-sampling): chain drafters sample drafts of sampled requests from their
        own distribution instead of SGLang's argmax; spec_auto (ours, --spec-auto): pick k per step by measured
        cost (spec_policy.AutoSteps). cuda_graph: SGLang's graph flags; on CUDA decode, verify and MTP draft
        steps replay captured graphs (engine/model_executor/cuda_graph.py), and the KV caches keep one scratch slot for
        padded rows.
        overlap_schedule: launch each plain decode step before reading the previous one (overlap.py); None = on for
        plain decoding on CUDA (SGLang's default; off with --disable-overlap-schedule).
        kernels: the Triton kernels CUDA forwards use (engine/kernels; None: all of them, as SGLang's defaults pick
        its fast kernels); none on CPU.
        memory_saver: SGLang's --enable-memory-saver (CUDA, torch_memory_saver): weights, KV caches and graphs in
        the saver's regions, so a memory release keeps their addresses and no graph is captured again
        (model_executor/memory_saver.py)."""
        from transformers import AutoTokenizer

        dtype = canonical_dtype(dtype)  # refuses an unknown name before loading anything
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests={max_running_requests}: must be at least 1")
        spec_policy.check_spec_options(spec, draft_sampling, spec_auto)
        policy = spec_policy.make_policy(spec, spec_auto)
        self.device = torch.device(device)
        self.model, self.model_config = load_model(model_path, dtype=dtype, device=device)
        self.fp8 = fp8.Fp8BlockScheme.from_hf_config(self.model_config)  # an FP8 checkpoint, held dequantized
        if spec is not None:
            check_resolved(spec, target_config=self.model_config, backend="embedded")
        self.spec = spec
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.vocab_size = self.model.args.vocab_size
        self.context_length = int(context_length or self.model.args.max_position_embeddings)
        self.eos_token_ids = eos_ids(Path(model_path), self.model_config, self.tokenizer)
        self.finish_rules = FinishRules(self.tokenizer, self.eos_token_ids, self.context_length)
        self.max_running_requests = max_running_requests
        num_steps = policy.max_num_steps if policy is not None else 0
        self.max_seq = self.context_length + num_steps + 1  # a verify writes num_steps positions past the last token
        slots = max_running_requests + 1  # + the scratch slot
        if self.device.type == "cuda":
            error = cache_fits_error(self.model.cache_bytes(slots, self.max_seq), torch.cuda.mem_get_info()[0],
                                     max_running_requests, self.context_length)
            if error:
                raise ValueError(error)
        self.cache = self.model.new_cache(slots, self.max_seq)
        drafter = make_drafter(spec, self.model, slots, self.max_seq, dtype, device,
                               num_steps=num_steps)
        self.spec_worker = None if spec is None else SpecWorker(self, drafter, policy,
                                                                tree_shape=tree.tree_shape(spec),
                                                                draft_sampling=draft_sampling)
        if self.device.type == "cuda":
            for model in self.causal_lms():
                model.fuse_projections()
                model.use_kernels(kernels or Kernels.from_values({}))
        # A chain's plain steps (k = 0) overlap where the drafter can wait for their read-back (base.py); a tree
        # never runs one.
        overlaps_plain_steps = self.drafter is None or (
            self.drafter.defers_plain_steps and tree.tree_shape(spec) is None)
        if overlap_schedule and not overlaps_plain_steps:
            raise ValueError(f"overlap_schedule=True with {spec.speculative_algorithm} (eagle_topk "
                             f"{spec.speculative_eagle_topk}): the overlap schedule runs plain decoding, and the plain "
                             "steps of EAGLE/NEXTN or STANDALONE chains; set --disable-overlap-schedule")
        if overlap_schedule is None:
            overlap_schedule = self.device.type == "cuda" and overlaps_plain_steps
        on_appended = None if self.spec_worker is None else self.spec_worker.after_overlapped_step
        self.overlap = OverlapDecode(self, on_appended) if overlap_schedule else None  # before capture: its buffer
        self.cuda_graph = cuda_graph or CudaGraphSettings()
        self.graph_capture_seconds = 0.0
        self.session_runners: dict | None = None  # weights/updater.select_runners' cache while a session is open
        self.memory = MemoryOccupation(self, memory_saver)  # with the saver: weights and caches moved into it
        self.generator = torch.Generator(device=self.device).manual_seed(seed)  # before capture: graphs draw from it
        self.capture_graphs()
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []
        self._rows: dict[str, Row] = {}      # rid -> row, for every request not yet returned by step()
        self._aborted_waiting = 0             # rows in `waiting` marked aborted, removed at the next step
        self.free_slots = list(range(max_running_requests))
        self._finished_early: list[Row] = []
        self._params_key: tuple = ()           # the rows `_params_value` was built for
        self._params_value: sampling.BatchParams | None = None
        small = self.model.args.hidden_size <= 1024
        self.cpu_threads = cpu_threads or (1 if self.device.type == "cpu" and small else None)

    # ------------------------------------------------------------------ requests
    def add_request(self, req: Request) -> None:
        ids = req.input_ids
        if not ids:
            raise ValueError(f"request {req.rid}: input_ids is empty; send a non-empty prompt")
        if req.rid in self._rows:
            raise ValueError(f"request {req.rid}: a request with this rid is already running")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {req.rid}: token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")
        req.params.validate()
        if len(ids) >= self.context_length:
            raise ValueError(f"The input ({len(ids)} tokens) is longer than the model's context length "
                             f"({self.context_length} tokens).")
        if len(ids) + req.params.max_new_tokens > self.context_length:
            raise ValueError(f"Requested token count exceeds the model's maximum context length of "
                             f"{self.context_length} tokens. You requested a total of "
                             f"{len(ids) + req.params.max_new_tokens} tokens: {len(ids)} tokens from the input "
                             f"messages and {req.params.max_new_tokens} tokens for the completion. Please reduce "
                             "the number of tokens in the input messages or the completion to fit within the limit.")
        row = Row(req=req, tokens=list(ids))
        self.waiting.append(row)
        self._rows[req.rid] = row

    def abort(self, rid: str) -> bool:
        """O(1): a waiting row is marked and leaves the queue at the next step (so aborting many stays linear)."""
        row = self._rows.get(rid)
        if row is None or row.finish is not None:
            return False
        if row.slot < 0:
            row.finish = {"type": "abort", "message": "Abort in waiting queue"}
            self._aborted_waiting += 1
        else:
            row.finish = {"type": "abort", "message": "Abort request"}
        return True

    def abort_all(self) -> None:
        for rid in list(self._rows):
            self.abort(rid)

    def has_work(self) -> bool:
        in_flight = self.overlap is not None and self.overlap.in_flight is not None
        return bool(self.waiting or self.running or self._finished_early or in_flight)

    @property
    def released_tags(self) -> list[str]:
        """Memory released by release_memory_occupation and not resumed; empty when the engine can step."""
        return sorted(self.memory.released)

    @property
    def avg_spec_accept_length(self) -> float:
        """Accepted tokens (drafts + bonus) per (request, verify pass) since start, as SGLang's scheduler counts."""
        return self.spec_worker.avg_accept_length if self.spec_worker is not None else 1.0

    @property
    def step_times(self) -> StepTimes:
        """Speculative steps' seconds per phase (speculative.StepTimes); all zero without speculation."""
        return self.spec_worker.times if self.spec_worker is not None else StepTimes()

    @property
    def drafter(self) -> Drafter | None:
        """The speculative worker's drafter; None without speculation."""
        return self.spec_worker.drafter if self.spec_worker is not None else None

    @property
    def policy(self) -> spec_policy.StepPolicy | None:
        """How many draft tokens each speculative step proposes (the speculative worker's); None without."""
        return self.spec_worker.policy if self.spec_worker is not None else None

    # ------------------------------------------------------------------ scheduling
    def step(self) -> list[Output]:
        with intra_op_threads(self.cpu_threads):
            return self._step()

    def _step(self) -> list[Output]:
        self._drop_aborted_waiting()
        if self.memory.released:
            return self._collect()
        new_rows = []
        while self.waiting and self.free_slots:
            row = self.waiting.popleft()
            row.slot = self.free_slots.pop()
            self.running.append(row)
            if self.finish_rules.max_new_tokens(row) == 0:  # as SGLang clips it to the context
                row.finish = {"type": "length", "length": 0}
            else:
                new_rows.append(row)
        if new_rows:
            self._prefill(new_rows)
            # With nothing in flight, a speculative engine's next plain step puts every row's last token itself
            # (SpecWorker.overlapped_plain_step), and a speculative step reads them on the host.
            if self.overlap is not None and (self.drafter is None or self.overlap.in_flight is not None):
                self.overlap.after_prefill([r for r in new_rows if r.finish is None])
        active = [r for r in self.running if r.finish is None]
        if self.spec_worker is not None and active:
            self.spec_worker.step(active)
        elif self.overlap is not None:
            self.overlap.step(active)  # with no row (always, for a speculative engine): the step in flight is read
        elif active:
            self.decode(active)
        return self._collect()

    def _drop_aborted_waiting(self) -> None:
        if self._aborted_waiting:
            self._finished_early += [r for r in self.waiting if r.finish is not None]
            self.waiting = deque(r for r in self.waiting if r.finish is None)
            self._aborted_waiting = 0

    def _collect(self) -> list[Output]:
        done = [r for r in self.running if r.finish is not None]
        self.running = [r for r in self.running if r.finish is None]
        for r in done:
            self.free_slots.append(r.slot)
        done += self._finished_early
        self._finished_early = []
        for r in done:
            self._rows.pop(r.req.rid, None)
        return [self.finish_rules.output(r) for r in done]

    def batch_params(self, rows: list[Row]) -> sampling.BatchParams:
        """The rows' sampling parameters (sampling.BatchParams). Built once per batch composition: between
        admissions and finishes every step reuses them; a rebuild is one pinned, non-blocking copy."""
        key = tuple(rows)  # rows compare by identity, and the tuple keeps them alive, so no id is reused
        if self._params_key != key:
            self._params_value = sampling.batch_params([r.req.params for r in rows], self.vocab_size, self.device)
            self._params_key = key
        return self._params_value

    @staticmethod
    def non_finite_rows(logits: torch.Tensor) -> tuple[torch.Tensor, set[int]]:
        """sampling.mask_non_finite with the broken rows read back as indices (prefill, tree verify)."""
        logits, broken = sampling.mask_non_finite(logits)
        return logits, set(broken.nonzero().flatten().tolist())

    def _pick(self, rows: list[Row], logits: torch.Tensor) -> tuple[list[int], list[float] | None]:
        """Next token per row from logits [B, V] (greedy or SGLang-filtered sampling), plus logprobs if asked."""
        tokens, logprobs = self._pick_on_device(rows, logits)
        return tokens.tolist(), None if logprobs is None else logprobs.tolist()

    def plain_greedy(self, rows: list[Row]) -> bool:
        """Whether every row takes the argmax and no row asks for logprobs (a captured step's own pick serves)."""
        return self.batch_params(rows).all_greedy and not any(r.req.return_logprob for r in rows)

    def _pick_on_device(self, rows: list[Row], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_pick` without reading back: tokens [B] and logprobs [B] (or None) stay on the device. `logits` as the
        lm_head gives them (a fresh tensor): a row holding NaN or inf gets a token and logprob -log V, as from
        zeroed logits, and the caller finishes it."""
        p = self.batch_params(rows)
        wants_logprobs = any(r.req.return_logprob for r in rows)
        if p.unfiltered and self.model.kernels.sampling:  # the RL case, in one pass per row (kernels/sampling.py)
            drawn = sample_rows(logits, p.temps, self.generator)
            if not wants_logprobs:
                return drawn.tokens, None
            return drawn.tokens, (drawn.token_z - drawn.lse).masked_fill_(~drawn.finite, -math.log(logits.shape[-1]))
        logits = sampling.finite_float32(logits)
        if p.all_sampled:  # no per-row copies
            tokens = sampling.sample(p.sampled_probs(logits), self.generator)
        else:
            tokens = logits.argmax(-1)
            if not p.all_greedy:
                drawn = sampling.sample(p.sampled_probs(p.of_sampled(logits)), self.generator)
                tokens.index_copy_(0, p.sampled, drawn)
        logprobs = None
        if wants_logprobs:
            logprobs = sampling.token_logprobs(logits, p.temps, p.greedy, tokens)
        return tokens, logprobs

    def _prefill(self, rows: list[Row]) -> None:
        dev = self.device
        width = max(len(r.tokens) for r in rows)
        graph = prefill_graph(self.model.graphs, len(rows), width)  # captured on CUDA (model_graphs.prefill_graphs)
        if graph is not None:
            width = graph.token_counts[0]
        # one host-to-device copy: each row's padded prompt, its slot and its last prompt position
        inputs = device_tensor([r.tokens + [0] * (width - len(r.tokens)) + [r.slot, len(r.tokens) - 1]
                                for r in rows], dev)
        ids, slots, last = inputs[:, :width], inputs[:, width], inputs[:, width + 1]
        positions = torch.arange(width, device=dev)[None].expand(len(rows), width)
        aux_ids = self.drafter.aux_layer_ids if self.drafter else None  # EAGLE3 drafts from the target's aux states
        if graph is not None:
            out = graph(ids, positions, slots, width)
        else:
            out = self.model(ids, positions, self.cache, slots, aux_layer_ids=aux_ids)
        hidden, features = out if aux_ids else (out, out)
        logits = self.model.logits(hidden[torch.arange(len(rows), device=dev), last], upcast=False)
        broken = set(sampling.non_finite(logits).nonzero().flatten().tolist())
        tokens, logprobs = self._pick(rows, logits)
        alive = []
        for i, row in enumerate(rows):
            row.kv_len = len(row.tokens)
            self.append_tokens(row, [tokens[i]], None if logprobs is None else [logprobs[i]])
            if i in broken:
                row.finish = dict(NAN_FINISH)
            if row.finish is None:
                alive.append(i)
        if self.drafter is not None and alive:
            self.drafter.on_prefill([rows[i] for i in alive], features[device_tensor(alive, dev)])

    def decode(self, rows: list[Row]) -> torch.Tensor:
        """One plain step for every row; returns what a drafter keeps of it (decode_forward's features).
        One host-to-device copy in (token, position, slot per row) and one read back (tokens, the non-finite
        flags, logprobs): on a GPU every extra copy or sync is time the device sits idle."""
        inputs = device_tensor([[r.tokens[-1], r.kv_len, r.slot] for r in rows], self.device)
        hidden, _, values = self.decode_forward(rows, inputs[:, 0:1], inputs[:, 1:2], inputs[:, 2])
        self.append_decoded(rows, values.tolist())
        return hidden

    def decode_forward(self, rows: list[Row], ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step on the device, nothing read back: (features [B, 1, ...], tokens [B], values [2 or 3, B]:
        the token, its non-finite flag and, when asked, its logprob per row). Each row's kv_len counts the step.
        features: what a drafter keeps of the step, the target's hidden states, or an EAGLE3 draft's aux states."""
        aux_ids = self.drafter.aux_layer_ids if self.drafter else None
        out = self.model(ids, positions, self.cache, slots, max(r.kv_len for r in rows) + 1, aux_layer_ids=aux_ids)
        hidden, features = out if aux_ids else (out, out)
        logits = self.model.logits(hidden[:, 0], upcast=False)
        broken = sampling.non_finite(logits)  # a broken row ends on append
        tokens, logprobs = self._pick_on_device(rows, logits)
        for row in rows:
            row.kv_len += 1
        values = torch.stack([tokens.double(), broken.double()] + ([] if logprobs is None else [logprobs.double()]))
        return features, tokens, values

    def append_decoded(self, rows: list[Row], values: list[list[float]]) -> None:
        """Append a decode step's read-back `values` (decode_forward's) to rows still running; a row that finished
        or was aborted after the step was launched (the overlap schedule) drops its token."""
        for i, row in enumerate(rows):
            if row.finish is not None:
                continue
            self.append_tokens(row, [int(values[0][i])], [values[2][i]] if len(values) == 3 else None)
            if values[1][i]:
                row.finish = dict(NAN_FINISH)

    # ------------------------------------------------------------------ finishing
    def append_tokens(self, row: Row, tokens: list[int], logprobs: list[float] | None) -> None:
        """Append tokens one by one, stopping at the first finish (finish.py: SGLang's stop rules)."""
        self.finish_rules.append_tokens(row, tokens, logprobs)

    # ------------------------------------------------------------------ cache and memory
    def flush_cache(self) -> bool:
        """No prefix cache is kept, so there is nothing to drop; like SGLang, refuse while requests run."""
        return not self._rows

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the KV caches ("kv_cache"), weights ("weights": kept in a CPU backup) and/or CUDA graphs while idle
        (no tags: all three, as SGLang); memory_occupation.py."""
        tags = memory_occupation.check_tags(tags)
        if self.overlap is not None:
            self.overlap.drain()
        if self._rows:
            raise ValueError("release_memory_occupation needs an idle engine: abort or finish requests first")
        self.memory.release(tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self.memory.resume(memory_occupation.check_tags(tags))

    def capture_graphs(self) -> None:
        """On CUDA (unless --disable-cuda-graph), capture decode, verify and draft forwards
        (engine/model_executor/cuda_graph.py): MTP
        steps, a STANDALONE draft's steps and catch-up, an EAGLE3 chain's aux-returning verify and draft-head steps,
        a chain verify's acceptance for the batches the sampling kernel serves (engine/speculative/accept_graph.py);
        with eagle_topk > 1 the tree's verify, draft steps and draft extend or catch-up
        (engine/speculative/tree_graphs.py)."""
        if self.device.type != "cuda" or self.cuda_graph.disable:
            return
        shape = tree.tree_shape(self.spec)
        if shape is not None:
            self.graph_capture_seconds = capture_tree_graphs(self, shape)
            return
        mtp = self.drafter.mtp if isinstance(self.drafter, HybridDrafter) else self.drafter
        mtp_cache = mtp.cache if isinstance(mtp, MTPDrafter) else None  # an EAGLE3 head captures its own, below
        widest = self.policy.max_num_steps if self.policy is not None else 0
        self.model.graphs = graph_model(self.model, self.cache, mtp_cache, self.cuda_graph,
                                        max_running_requests=self.max_running_requests,
                                        max_draft_tokens=widest, max_seq=self.max_seq,
                                        aux_layer_ids=self.drafter.aux_layer_ids if self.drafter else None,
                                        chain_lengths=self.policy.draft_lengths() if self.policy is not None else (),
                                        verify_widths=self.policy.verify_widths() if self.policy is not None else None,
                                        last_token=self.overlap.last_token if self.overlap is not None else None,
                                        prefill=True)
        widths = [w for w in self.policy.verify_widths() if w > 1] if self.policy is not None else []
        if widths and self.model.kernels.sampling:  # a chain verify's acceptance, for the batches the kernel serves
            self.model.graphs["chain_accept"] = AcceptGraph(
                self.model, self.generator, batch_sizes=self.cuda_graph.capture_sizes(self.max_running_requests, True),
                widths=widths, device=self.device)
            self.model.graphs["chain_accept"].capture()
        draft = self.causal_lms()[1:]
        if draft:
            # A STANDALONE draft's one-token chain steps, and its catch-up before each chain: 1 or 2 tokens after a
            # verify, up to k + 1 after plain steps (longer ones, and the prefill, run eagerly).
            draft[0].graphs = graph_model(draft[0], self.drafter.cache, None, self.cuda_graph,
                                          max_running_requests=self.max_running_requests, max_draft_tokens=widest,
                                          max_seq=self.max_seq)
        self.graph_capture_seconds = sum(g.capture_seconds for m in self.causal_lms() for g in m.graphs.values())
        if self.drafter is not None:  # its own chain graphs (EAGLE3's steps and extend)
            self.graph_capture_seconds += self.drafter.capture_graphs(self.cuda_graph, self.max_running_requests)

    def causal_lms(self) -> list:
        """The target, and a STANDALONE draft model: what fuses projections and captures graphs on CUDA."""
        draft = self.drafter.draft if self.drafter is not None else None
        return [self.model] + ([draft] if isinstance(draft, CausalLM) else [])

    def unique_params(self) -> list[torch.nn.Parameter]:
        """Every parameter the engine serves once (shared embedding/lm_head included once), drafts included."""
        params = list(self.model.parameters())
        draft = self.drafter.draft if self.drafter is not None else None
        return params + (list(draft.parameters()) if draft is not None else [])

    # ------------------------------------------------------------------ weights
    def named_weights(self, selector: str) -> dict[str, torch.Tensor]:
        """Served weights by HF name for the runners `selector` reaches (see weight_updater.select_runners)."""
        return weight_updater.named_weights(weight_updater.select_runners(self.model, self.drafter, selector,
                                                                          self.session_runners))

    def dequantized(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """An update's tensors as this engine holds them: an FP8 checkpoint's weights, each with its block scale in
        the same update, replaced by their values (fp8.Fp8ConfigError, a ValueError, for an unpaired one)."""
        return named if self.fp8 is None else fp8.dequantize_pairs(named, self.fp8)

    def plan_weights(self, named: list[tuple[str, torch.Tensor]], selector: str = "all"
                     ) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """The (parameter, tensor) copies `named` makes, every name, shape and dtype checked (ValueError on any
        error); `named` may be meta tensors, so a receiver can check an update before its bytes arrive."""
        if "weights" in self.memory.released:
            raise ValueError("weights are released (release_memory_occupation); resume them before loading")
        runners = weight_updater.select_runners(self.model, self.drafter, selector, self.session_runners)
        return weight_updater.plan_load(runners, named, tied=self.model.args.tie_word_embeddings, selector=selector,
                                        algorithm=self.spec.speculative_algorithm if self.spec else None)

    def load_weights(self, named: list[tuple[str, torch.Tensor]], selector: str = "all") -> None:
        """Load HF-named tensors into every selected runner that has the name; all or nothing: every name, shape
        and dtype is checked before the first copy, and a bad one raises ValueError with the old weights intact."""
        plan = self.plan_weights(named, selector)
        if self.overlap is not None:
            self.overlap.drain()  # the step in flight was launched with the old weights: its tokens come first
        with torch.no_grad():
            for param, tensor in plan:
                self.memory.load(param, tensor.to(device=param.device, dtype=param.dtype))


def cache_fits_error(cache_bytes: int, free_bytes: int, max_running_requests: int, context_length: int) -> str | None:
    """Why the KV cache cannot be allocated, or None. The embedded engine holds a static cache of every slot at the
    full context length (SGLang sizes its pool by --mem-fraction-static instead), so a long context times many
    slots can exceed the GPU before a token is generated: say which flags size it."""
    if cache_bytes <= free_bytes:
        return None
    gib = 1 << 30
    return (f"the embedded engine's KV cache needs {cache_bytes / gib:.1f} GiB ({max_running_requests + 1} slots: "
            f"--max-running-requests {max_running_requests} + 1, each of --context-length {context_length} tokens) "
            f"and the GPU has {free_bytes / gib:.1f} GiB free after the weights; lower --context-length or "
            "--max-running-requests")
