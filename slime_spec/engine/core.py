"""EngineCore: continuous batching over a static KV cache, with optional speculative decoding.

One `step()` admits waiting requests into free cache slots (one batched prefill), then runs one batched
decode pass (or draft + verify pass) over every running request, and returns the requests that finished.
Called from a single thread (the server's engine thread); nothing here locks.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from slime_spec.dtypes import canonical_dtype
from slime_spec.engine.cuda_graph import CudaGraphSettings, graph_model
from slime_spec.engine import sampling, spec_policy, weight_updater
from slime_spec.engine.drafters import make_drafter
from slime_spec.engine.model import load_model
from slime_spec.engine.speculative import StepTimes, spec_step
from slime_spec.spec import SpecConfig, check_resolved
from slime_spec.threads import intra_op_threads

__all__ = ["EngineCore", "Output", "Request", "SamplingParams", "SpecConfig"]

NAN_FINISH = {"type": "stop", "matched": "NaN happened"}  # SGLang's FINISH_MATCHED_STR for non-finite logits


@dataclass
class SamplingParams:
    """SGLang's names and defaults (sglang/srt/sampling/sampling_params.py)."""

    temperature: float = 1.0     # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1              # -1 = off
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def validate(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not (self.temperature >= 0 and self.temperature != float("inf")):
            raise ValueError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.max_new_tokens is None or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    history: object = None  # drafters.history.HistoryRef: the slime-spec extension `slime_history`


@dataclass
class Output:
    rid: str
    output_ids: list[int]
    output_logprobs: list[float] | None   # the target's logprob of each output token (see sampling.py)
    finish_reason: dict                   # SGLang's finish_reason JSON: length | stop (matched) | abort
    prompt_tokens: int
    completion_tokens: int
    spec_verify_ct: int                   # verify passes of this request
    spec_accept_token_num: int            # accepted draft tokens (bonus tokens excluded)
    spec_draft_token_num: int             # draft tokens proposed
    text: str                             # detokenized output


@dataclass(eq=False)
class _Row:
    req: Request
    slot: int = -1
    tokens: list[int] = field(default_factory=list)  # prompt + output
    kv_len: int = 0                                  # tokens in the target KV cache: all but the pending last
    logprobs: list[float] = field(default_factory=list)
    finish: dict | None = None
    verify_ct: int = 0
    accept_num: int = 0
    draft_num: int = 0
    draft_cached_len: int = 0                        # STANDALONE: tokens in the draft model's KV cache
    draft_state: dict = field(default_factory=dict)  # drafters' per-row state (n-gram hashes, history cursors)
    ngram_upto: int = 1                              # NGRAM: n-grams ending before this position are indexed

    @property
    def prompt_len(self) -> int:
        return len(self.req.input_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]


def _eos_ids(model_path: Path, config: dict, tokenizer) -> set[int]:
    ids: set[int] = set()
    sources = [config.get("eos_token_id")]
    gen = model_path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    sources.append(tokenizer.eos_token_id)
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, list):
            ids.update(int(x) for x in s)
    return ids


class EngineCore:
    nan_finish = NAN_FINISH

    def __init__(self, model_path: str, spec: SpecConfig | None, *, dtype: str = "float32", device: str = "cpu",
                 max_running_requests: int = 32, context_length: int | None = None, seed: int = 0,
                 cpu_threads: int | None = None, draft_sampling: bool = False, spec_auto: bool = False,
                 cuda_graph: CudaGraphSettings | None = None):
        """spec: resolved speculative settings (slime_spec.spec.resolve), None without speculation.
        cpu_threads: intra-op threads while stepping on CPU; None = 1 for small models (hidden <= 1024), where
        thread hand-off costs more than the tiny matmuls gain, else torch's default.
        draft_sampling (ours, --spec-draft-sampling): chain drafters sample drafts of sampled requests from their
        own distribution instead of SGLang's argmax; spec_auto (ours, --spec-auto): pick k per step by measured
        cost (spec_policy.AutoSteps). cuda_graph: SGLang's graph flags; on CUDA decode, verify and MTP draft
        steps replay captured graphs (cuda_graph.py), and the KV caches keep one scratch slot for padded rows."""
        from transformers import AutoTokenizer

        dtype = canonical_dtype(dtype)  # refuses an unknown name before loading anything
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests={max_running_requests}: must be at least 1")
        spec_policy.check_spec_options(spec, draft_sampling, spec_auto)
        self.draft_sampling = draft_sampling
        self.policy = spec_policy.make_policy(spec, spec_auto)
        self.timed = isinstance(self.policy, spec_policy.AutoSteps)  # costs are measured (CUDA: synchronized)
        self.device = torch.device(device)
        self.model, self.model_config = load_model(model_path, dtype=dtype, device=device)
        if spec is not None:
            check_resolved(spec, target_config=self.model_config, backend="embedded")
        self.spec = spec
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.vocab_size = self.model.args.vocab_size
        self.context_length = int(context_length or self.model.args.max_position_embeddings)
        self.eos_token_ids = _eos_ids(Path(model_path), self.model_config, self.tokenizer)
        self.max_running_requests = max_running_requests
        k = self.policy.max_k if self.policy is not None else 0
        self.max_seq = self.context_length + k + 1  # a verify pass writes k positions past the last token
        self.cache = self.model.new_cache(max_running_requests + 1, self.max_seq)  # + the scratch slot
        self.drafter = make_drafter(spec, self.model, max_running_requests + 1, self.max_seq, dtype, device, k=k)
        if self.device.type == "cuda":
            self.model.fuse_projections()
        self.cuda_graph = cuda_graph or CudaGraphSettings()
        self.graph_capture_seconds = 0.0
        self._capture_graphs()
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.waiting: deque[_Row] = deque()
        self.running: list[_Row] = []
        self._rows: dict[str, _Row] = {}      # rid -> row, for every request not yet returned by step()
        self._aborted_waiting = 0             # rows in `waiting` marked aborted, removed at the next step
        self.free_slots = list(range(max_running_requests))
        self._finished_early: list[_Row] = []
        self._accept_tokens = 0  # sum over verify passes of (accepted + 1), as SGLang's avg_spec_accept_length
        self._verify_passes = 0
        self.step_times = StepTimes()  # speculative steps' seconds per phase (speculative.StepTimes)
        self._released: set[str] = set()
        self._weight_backup: dict[int, torch.Tensor] = {}
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
        row = _Row(req=req, tokens=list(ids))
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
        return bool(self.waiting or self.running or self._finished_early)

    @property
    def released_tags(self) -> list[str]:
        """Memory released by release_memory_occupation and not resumed; empty when the engine can step."""
        return sorted(self._released)

    @property
    def avg_spec_accept_length(self) -> float:
        """Accepted tokens (drafts + bonus) per (request, verify pass) since start, as SGLang's scheduler counts."""
        return self._accept_tokens / self._verify_passes if self._verify_passes else 1.0

    # ------------------------------------------------------------------ scheduling
    def step(self) -> list[Output]:
        with intra_op_threads(self.cpu_threads):
            return self._step()

    def _step(self) -> list[Output]:
        self._drop_aborted_waiting()
        if self._released:
            return self._collect()
        new_rows = []
        while self.waiting and self.free_slots:
            row = self.waiting.popleft()
            row.slot = self.free_slots.pop()
            self.running.append(row)
            if row.req.params.max_new_tokens == 0:
                row.finish = {"type": "length", "length": 0}
            else:
                new_rows.append(row)
        if new_rows:
            self._prefill(new_rows)
        active = [r for r in self.running if r.finish is None]
        if active:
            self._spec_step(active) if self.drafter is not None else self._decode(active)
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
        return [self._output(r) for r in done]

    def _params(self, rows: list[_Row]):
        p = [r.req.params for r in rows]
        dev = self.device
        greedy = torch.tensor([sampling.is_greedy(x.temperature, x.top_k) for x in p], device=dev)
        temps = torch.tensor([x.temperature for x in p], dtype=torch.float32, device=dev)
        top_ks = torch.tensor([x.top_k if x.top_k > 0 else self.vocab_size for x in p], device=dev)
        top_ps = torch.tensor([x.top_p for x in p], dtype=torch.float32, device=dev)
        min_ps = torch.tensor([x.min_p for x in p], dtype=torch.float32, device=dev)
        return greedy, temps, top_ks, top_ps, min_ps

    @staticmethod
    def _non_finite_rows(logits: torch.Tensor) -> tuple[torch.Tensor, set[int]]:
        """Rows whose logits hold NaN/inf get zero logits (so sampling runs) and are finished by the caller, as
        SGLang finishes them ("NaN happened"), instead of one broken row crashing the whole batch."""
        if bool(torch.isfinite(logits.sum())):  # a finite sum means every entry is finite: one cheap check
            return logits, set()
        bad = ~torch.isfinite(logits).flatten(1).all(-1)
        if not bool(bad.any()):
            return logits, set()
        mask = bad.view(-1, *([1] * (logits.dim() - 1)))
        return logits.masked_fill(mask, 0.0), set(bad.nonzero().flatten().tolist())

    def _pick(self, rows: list[_Row], logits: torch.Tensor) -> tuple[list[int], list[float] | None]:
        """Next token per row from logits [B, V] (greedy or SGLang-filtered sampling), plus logprobs if asked."""
        greedy, temps, top_ks, top_ps, min_ps = self._params(rows)
        tokens = logits.argmax(-1)
        sampled = ~greedy
        if bool(sampled.any()):
            probs = sampling.filtered_probs(logits[sampled], temps[sampled], top_ks[sampled], top_ps[sampled],
                                            min_ps[sampled])
            tokens[sampled] = sampling.sample(probs, self.generator)
        logprobs = None
        if any(r.req.return_logprob for r in rows):
            logprobs = sampling.token_logprobs(logits, temps, greedy, tokens).tolist()
        return tokens.tolist(), logprobs

    def _prefill(self, rows: list[_Row]) -> None:
        dev = self.device
        width = max(len(r.tokens) for r in rows)
        ids = torch.tensor([r.tokens + [0] * (width - len(r.tokens)) for r in rows], device=dev)
        positions = torch.arange(width, device=dev)[None].expand(len(rows), width)
        slots = torch.tensor([r.slot for r in rows], device=dev)
        aux_ids = getattr(self.drafter, "aux_layer_ids", None)  # EAGLE3 drafts from the target's aux states
        out = self.model(ids, positions, self.cache, slots, aux_layer_ids=aux_ids)
        hidden, features = out if aux_ids else (out, out)
        last = torch.tensor([len(r.tokens) - 1 for r in rows], device=dev)
        logits, broken = self._non_finite_rows(self.model.logits(hidden[torch.arange(len(rows), device=dev), last]))
        tokens, logprobs = self._pick(rows, logits)
        alive = []
        for i, row in enumerate(rows):
            row.kv_len = len(row.tokens)
            self._append(row, [tokens[i]], None if logprobs is None else [logprobs[i]])
            if i in broken:
                row.finish = dict(NAN_FINISH)
            if row.finish is None:
                alive.append(i)
        if self.drafter is not None and alive:
            self.drafter.on_prefill([rows[i] for i in alive], features[torch.tensor(alive, device=dev)])

    def _decode(self, rows: list[_Row]) -> torch.Tensor:
        """One plain step for every row; returns the target's hidden states [B, 1, H] (for a drafter to keep)."""
        dev = self.device
        ids = torch.tensor([[r.tokens[-1]] for r in rows], device=dev)
        positions = torch.tensor([[r.kv_len] for r in rows], device=dev)
        slots = torch.tensor([r.slot for r in rows], device=dev)
        num_keys = max(r.kv_len for r in rows) + 1
        hidden = self.model(ids, positions, self.cache, slots, num_keys)
        logits, broken = self._non_finite_rows(self.model.logits(hidden[:, 0]))
        tokens, logprobs = self._pick(rows, logits)
        for i, row in enumerate(rows):
            row.kv_len += 1
            self._append(row, [tokens[i]], None if logprobs is None else [logprobs[i]])
            if i in broken:
                row.finish = dict(NAN_FINISH)
        return hidden

    def _spec_step(self, rows: list[_Row]) -> None:
        spec_step(self, rows)

    # ------------------------------------------------------------------ finishing
    def _append(self, row: _Row, tokens: list[int], logprobs: list[float] | None) -> None:
        """Append tokens one by one, stopping at the first finish (SGLang's order: stop string, token, length)."""
        p = row.req.params
        for j, t in enumerate(tokens):
            row.tokens.append(t)
            if row.req.return_logprob:
                row.logprobs.append(logprobs[j])
            out_len = len(row.tokens) - row.prompt_len
            matched = self._matched_stop_str(row) if p.stop else None
            if matched is not None:
                row.finish = {"type": "stop", "matched": matched}
            elif not p.ignore_eos and (t in self.eos_token_ids or t in p.stop_token_ids):
                row.finish = {"type": "stop", "matched": t}
            elif out_len >= p.max_new_tokens:
                row.finish = {"type": "length", "length": p.max_new_tokens}
            elif len(row.tokens) >= self.context_length:
                row.finish = {"type": "length", "length": out_len}
            if row.finish is not None:
                return

    def _matched_stop_str(self, row: _Row) -> str | None:
        p = row.req.params
        window = max(len(s) for s in p.stop) + 1
        tail = self.tokenizer.decode(row.output_ids[-window:])
        for s in p.stop:
            if s and s in tail:
                return s
        return None

    def _output(self, row: _Row) -> Output:
        p = row.req.params
        out = row.output_ids
        text_ids = out
        if row.finish and row.finish["type"] == "stop" and isinstance(row.finish["matched"], int) \
                and not p.no_stop_trim and out:
            text_ids = out[:-1]
        text = self.tokenizer.decode(text_ids, skip_special_tokens=p.skip_special_tokens)
        if row.finish and row.finish["type"] == "stop" and isinstance(row.finish["matched"], str) \
                and not p.no_stop_trim:
            pos = text.find(row.finish["matched"])
            text = text[:pos] if pos != -1 else text
        return Output(rid=row.req.rid, output_ids=list(out),
                      output_logprobs=list(row.logprobs) if row.req.return_logprob else None,
                      finish_reason=dict(row.finish), prompt_tokens=row.prompt_len, completion_tokens=len(out),
                      spec_verify_ct=row.verify_ct, spec_accept_token_num=row.accept_num,
                      spec_draft_token_num=row.draft_num, text=text)

    # ------------------------------------------------------------------ cache and memory
    def flush_cache(self) -> bool:
        """No prefix cache is kept, so there is nothing to drop; like SGLang, refuse while requests run."""
        return not self._rows

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the KV caches ("kv_cache") and/or weights ("weights": kept in a CPU backup) while idle."""
        tags = self._check_tags(tags)
        if self._rows:
            raise ValueError("release_memory_occupation needs an idle engine: abort or finish requests first")
        if tags & {"kv_cache", "weights", "cuda_graph"}:
            self.model.graphs = {}  # they captured the storage being freed; captured again on resume
        if "kv_cache" in tags and "kv_cache" not in self._released:
            self.cache = None
            if self.drafter is not None:
                self.drafter.drop_cache()
            self._released.add("kv_cache")
        if "weights" in tags and "weights" not in self._released:
            self.model.unfuse_projections()
            for param in self._unique_params():
                self._weight_backup[id(param)] = param.data.to("cpu", copy=True)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            self._released.add("weights")

    def resume_memory(self, tags: list[str] | None = None) -> None:
        tags = self._check_tags(tags)
        if "weights" in tags and "weights" in self._released:
            for param in self._unique_params():
                param.data = self._weight_backup.pop(id(param)).to(self.device)
            self._released.discard("weights")
            if self.device.type == "cuda":
                self.model.fuse_projections()
        if "kv_cache" in tags and "kv_cache" in self._released:
            self.cache = self.model.new_cache(self.max_running_requests + 1, self.max_seq)
            if self.drafter is not None:
                self.drafter.new_cache()
            self._released.discard("kv_cache")
        if not self._released:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        """On CUDA (unless --disable-cuda-graph), capture decode, verify and MTP draft forwards (cuda_graph.py)."""
        if self.device.type != "cuda" or self.cuda_graph.disable:
            return
        mtp_cache = getattr(self.drafter, "cache", None) if getattr(self.drafter, "target", None) is self.model else None
        self.model.graphs = graph_model(self.model, self.cache, mtp_cache, self.cuda_graph,
                                        max_running_requests=self.max_running_requests,
                                        max_draft_tokens=self.policy.max_k if self.policy is not None else 0,
                                        max_seq=self.max_seq)
        self.graph_capture_seconds = sum(g.capture_seconds for g in self.model.graphs.values())

    @staticmethod
    def _check_tags(tags: list[str] | None) -> set[str]:
        tags = set(tags) if tags else {"weights", "kv_cache"}
        unknown = tags - {"weights", "kv_cache", "cuda_graph"}
        if unknown:
            raise ValueError(f"tags {sorted(unknown)}: known memory tags are 'weights', 'kv_cache', 'cuda_graph'")
        return tags

    def _unique_params(self) -> list[torch.nn.Parameter]:
        """Every parameter the engine serves once (shared embedding/lm_head included once), drafts included."""
        params = list(self.model.parameters())
        draft = getattr(self.drafter, "draft", None)
        return params + (list(draft.parameters()) if draft is not None else [])

    # ------------------------------------------------------------------ weights
    def named_weights(self, selector: str) -> dict[str, torch.Tensor]:
        """Served weights by HF name for the runners `selector` reaches (see weight_updater.select_runners)."""
        return weight_updater.named_weights(weight_updater.select_runners(self.model, self.drafter, selector))

    def plan_weights(self, named: list[tuple[str, torch.Tensor]], selector: str = "all"
                     ) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """The (parameter, tensor) copies `named` makes, every name, shape and dtype checked (ValueError on any
        error); `named` may be meta tensors, so a receiver can check an update before its bytes arrive."""
        if "weights" in self._released:
            raise ValueError("weights are released (release_memory_occupation); resume them before loading")
        runners = weight_updater.select_runners(self.model, self.drafter, selector)
        return weight_updater.plan_load(runners, named, tied=self.model.args.tie_word_embeddings, selector=selector,
                                        algorithm=self.spec.speculative_algorithm if self.spec else None)

    def load_weights(self, named: list[tuple[str, torch.Tensor]], selector: str = "all") -> None:
        """Load HF-named tensors into every selected runner that has the name; all or nothing: every name, shape
        and dtype is checked before the first copy, and a bad one raises ValueError with the old weights intact."""
        plan = self.plan_weights(named, selector)
        with torch.no_grad():
            for param, tensor in plan:
                param.copy_(tensor.to(device=param.device, dtype=param.dtype))
