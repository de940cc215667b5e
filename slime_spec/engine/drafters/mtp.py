"""NEXTN / EAGLE drafting with the model's MTP layer 0 (MiMo's, or GLM-4.5's / DeepSeek-V3's NextN layer; SGLang's
EAGLE worker: a chain, or a tree with eagle_topk > 1)."""

from __future__ import annotations

import torch

from slime_spec.engine.drafters.base import Drafter, DraftPick, argmax_pick, chain, slots_of, tree_frame
from slime_spec.engine.model_executor.cuda_graph import GraphedForward, key_buckets
from slime_spec.engine.model_executor.model import CausalLM, KVCache, hf_weight_names
from slime_spec.engine.model_executor.model_graphs import mtp_chain_name
from slime_spec.engine.model_executor.transfer import device_tensor
from slime_spec.engine.speculative import tree, tree_graphs


class MTPDrafter(Drafter):
    """NEXTN / EAGLE with the model's MTP layer 0, driven like SGLang's EAGLE worker drives one MTP layer.

    Draft position p reads (token x_{p+1}, hidden h_p). After each target forward, a draft extend runs over the
    newly verified positions with the target's hidden states (tokens shifted left by one); its last output gives
    the first draft token and hidden. Further draft tokens run the same layer on its own output hidden state.

    Plain steps (k = 0, chosen by adaptive or auto speculation) draft nothing, so their extend is deferred: the
    committed token and the target's hidden state wait in `pending` per slot, and the next draft runs one
    batched extend over all of them (one MTP call instead of one per plain step); the engine runs it
    through `catch_up_deferred` before drafting, so its cost is measured apart from the draft step's. The prefill's
    extend over the prompt waits the same way: a request that never drafts (auto or adaptive speculation at k = 0
    all its life) never pays for its MTP prefill, and one that does pays it in the same batched call.
    """

    defers_plain_steps = True  # a plain step's extend waits in `pending` anyway (base.py)
    supports_tree = True
    extends_before_read_back = True
    owns_weights = True

    def __init__(self, target: CausalLM, num_steps: int, slots: int, max_seq: int):
        self.target, self.num_steps, self.slots, self.max_seq = target, num_steps, slots, max_seq
        device = target.lm_head.weight.device
        self.next_hidden = torch.zeros(slots, target.args.hidden_size, dtype=target.lm_head.weight.dtype,
                                       device=device)
        self.cache: KVCache | None = None
        # Deferred extends: per step (hidden [B, T, H], {slot: row}, tokens per row, first position per row) and per
        # slot the steps it waits on. A plain step's row has one token (an int) at hidden [row, 0], a prefill's a list
        # (the prompt shifted) at [row, :len]. Queueing a plain step costs one int appended per row: no tensor op and
        # no object per row that the garbage collector tracks (two per row and step, kept until the catch-up, made
        # a batch-128 run's collections cost ms, and a full one up to hundreds of ms).
        self.pending: dict[int, list[int]] = {}
        self.pending_steps: dict[int, tuple[torch.Tensor, dict[int, int], list, list[int]]] = {}
        self._step_id = 0
        self.ahead: tuple[list, int, torch.Tensor] | None = None  # (rows, k, drafts) drafted before a read-back
        self.new_cache()

    def new_cache(self) -> None:
        self.cache = self.target.new_mtp_cache(self.slots, self.max_seq)
        self.pending.clear()
        self.pending_steps.clear()
        self.ahead = None

    def drop_cache(self) -> None:
        self.cache = None
        self.pending.clear()
        self.pending_steps.clear()
        self.ahead = None

    def _extend(self, slots: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                last: torch.Tensor, num_keys: int | None = None) -> None:
        out = self.target.mtp_forward(tokens, hidden, positions, self.cache, slots, num_keys=num_keys)
        self.next_hidden[slots] = out[torch.arange(len(slots), device=out.device), last]

    def on_prefill(self, rows, hidden: torch.Tensor) -> None:
        """Queue the extend over each prompt: position p reads token x_{p+1} (the prompt shifted, plus the first
        output) and the target's hidden state at p; `catch_up_deferred` runs it before the row's first draft."""
        self._step_id += 1
        self.ahead = None
        self.pending_steps[self._step_id] = (hidden, {r.slot: i for i, r in enumerate(rows)},
                                             [r.tokens[1:] for r in rows], [0] * len(rows))
        for r in rows:
            self.pending[r.slot] = [self._step_id]

    def catch_up_deferred(self, rows) -> bool:
        """The deferred extends (prefills, plain steps), one batched MTP call over every waiting position; whether
        there was any. The hidden states are gathered in one index op from every waiting step's, flattened into one
        table: a row behind by a long run of plain steps (the tail of a batch 128, where a smaller batch's tier starts
        drafting) has one segment per step, and slicing them one by one took 24-38 ms of host time (GPU section of
        docs/en/benchmarks.md, issue 14)."""
        behind = [r for r in rows if r.slot in self.pending]
        if not behind:
            return False
        self.ahead = None
        queued = [self.pending.pop(r.slot) for r in behind]
        device, size = self.next_hidden.device, self.next_hidden.shape[1]
        info, parts, offset = {}, [], 0  # step -> (where its [B, T] positions start in the table, T, rows, tokens)
        for step in sorted({step for q in queued for step in q}):
            hidden, where, step_tokens, _ = self.pending_steps[step]
            info[step] = (offset, hidden.shape[1], where, step_tokens)
            parts.append(hidden.reshape(-1, size))
            offset += hidden.shape[0] * hidden.shape[1]
        parts.append(self.next_hidden.new_zeros(1, size))  # row `offset`: the padding's hidden state
        per_row, starts = [], []  # (gather index, tokens) per row; each row's first waiting position
        for r, q in zip(behind, queued):
            slot, index, tokens = r.slot, [], []
            for step in q:
                first, span, where, step_tokens = info[step]
                i = where[slot]
                t = step_tokens[i]
                if isinstance(t, int):  # a plain step's one token (its hidden states are [B, 1])
                    index.append(first + i)
                    tokens.append(t)
                else:  # a prefill's prompt
                    first += i * span
                    index.extend(range(first, first + len(t)))
                    tokens.extend(t)
            _, where, _, step_positions = self.pending_steps[q[0]]
            starts.append(step_positions[where[slot]])
            per_row.append((index, tokens))
        lengths = [len(index) for index, _ in per_row]
        width = max(lengths)
        index = [i for row_index, _ in per_row for i in row_index + [offset] * (width - len(row_index))]
        tokens = [t for _, row_tokens in per_row for t in row_tokens + [0] * (width - len(row_tokens))]
        n = len(behind)
        # one host-to-device copy: the gather index and tokens [n, width] each, then each row's first position
        # and last waiting position
        table = device_tensor(index + tokens + starts + [m - 1 for m in lengths], device)
        index, tokens = table[: n * width], table[n * width: 2 * n * width].view(n, width)
        start, last = table[2 * n * width: 2 * n * width + n], table[2 * n * width + n:]
        hidden = torch.cat(parts)[index].view(n, width, size)
        waiting = {step for q in self.pending.values() for step in q}
        for step in [s for s in self.pending_steps if s not in waiting]:
            del self.pending_steps[step]
        positions = start[:, None] + torch.arange(width, device=device)[None]
        num_keys = max(starts) + width  # positions.max() + 1, known on the host: no read-back
        self._extend(slots_of(behind, device), tokens, hidden, positions, last, num_keys)
        return True

    def propose(self, rows) -> torch.Tensor:
        return self.sample_draft(rows, argmax_pick)[0]

    def sample_draft(self, rows, pick: DraftPick) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens per row, each picked from the MTP layer's logits: one batched MTP + lm_head call per
        step for all rows. The first reads the hidden state the last extend left; each further one runs the layer
        on its own output. The engine runs `catch_up_deferred` first (SpecWorker.catch_up). Greedy drafting (SGLang's)
        replays the whole chain as one captured graph where there is one (model_graphs.mtp_chain)."""
        if pick is argmax_pick:
            drafted = self._take_ahead(rows)
            if drafted is not None:
                return drafted, None
        device = self.next_hidden.device
        slots, pos = device_tensor([(r.slot, r.kv_len) for r in rows], device).unbind(1)  # one host-to-device copy
        max_kv = max(r.kv_len for r in rows)  # host-side key count: a captured graph cannot read positions back
        hidden = self.next_hidden[slots]
        whole = self.target.graphs.get(mtp_chain_name(self.num_steps)) if pick is argmax_pick else None
        num_keys = max_kv + self.num_steps - 1
        if whole is not None and whole.serves(self.cache, pos[:, None], num_keys):
            return whole(pos[:, None], pos[:, None], slots, num_keys, prev_hidden=hidden[:, None]), None

        def step(j: int, token: torch.Tensor | None) -> torch.Tensor:
            nonlocal hidden
            if j > 0:
                hidden = self.target.mtp_forward(token[:, None], hidden[:, None], (pos + j - 1)[:, None], self.cache,
                                                 slots, num_keys=max_kv + j)[:, 0]
            return self.target.logits(hidden)

        return chain(self.num_steps, step, pick)

    def tree_draft(self, rows, shape: tree.TreeShape) -> tree.DraftTree:
        """A draft tree per row (eagle_topk > 1): the root's children from the hidden state the last extend left;
        each further step runs the layer once over every row's top-k frontier, node j of step i at cache location
        kv_len + i * topk + j (past the context, overwritten by the next extend) and RoPE position kv_len + i."""
        self.catch_up_deferred(rows)
        device = self.next_hidden.device
        slots, pos, num_keys = tree_frame(rows, shape.draft_region, device)
        first = self.next_hidden[slots]
        graph, eager = self.target.graphs.get("mtp_tree"), tree_graphs.mtp_tree_fn(self.target, self.cache)

        def step(i: int, tokens: torch.Tensor, hidden: torch.Tensor, visible: torch.Tensor):
            k = tokens.shape[1]
            out = tree_graphs.run_tree(graph, eager, self.cache, tokens, (pos + i)[:, None].expand(-1, k), slots,
                                       num_keys, base=pos, start=pos + i * k, visible=visible, prev_hidden=hidden)
            return self.target.logits(out), out

        root = device_tensor([r.tokens[-1] for r in rows], device)
        return tree.draft_tree(root, self.target.logits(first), first, step, shape)

    def tree_graphs(self, shape: tree.TreeShape, common: dict) -> list[GraphedForward]:
        """A tree's graphs of the MTP layer, kept with the target's (tree_graphs.capture_tree_graphs captures them):
        its draft steps over each row's topk frontier ("mtp_tree") and the extend over an accepted path, padded to
        steps + 1 positions ("mtp", which `mtp_forward` replays)."""
        model, cache = self.target, self.cache
        hidden = {"prev_hidden": ((model.args.hidden_size,), model.lm_head.weight.dtype)}

        def extend(ids, positions, slots, num_keys, prev_hidden):
            return model.eager_mtp_forward(ids, prev_hidden, positions, cache, slots, num_keys=num_keys, graphed=True)

        graphs = {"mtp": GraphedForward(extend, token_counts=[shape.steps + 1], key_counts=key_buckets(cache.max_seq),
                                        cache=cache, extra=hidden, **common),
                  "mtp_tree": tree_graphs.tree_graph(tree_graphs.mtp_tree_fn(model, cache, graphed=True),
                                                     nodes=shape.topk, region=shape.draft_region, cache=cache,
                                                     common=common, extra=hidden)}
        model.graphs.update(graphs)
        return list(graphs.values())

    def on_verify(self, rows, hidden: torch.Tensor, accepted: list[int]) -> None:
        if self.num_steps == 0:  # a plain step: defer its extend to the next draft (see catch_up_deferred)
            self.defer(rows, hidden, [r.kv_len - 1 for r in rows])
            return
        device = hidden.device
        k1 = hidden.shape[1]  # the verify pass's k + 1 positions
        # Row i verified positions n..n+k; its newly committed tokens x_{n+1}..x_{n+a+1} are tokens[-(a+1):]. One
        # host-to-device copy per row: those tokens padded to k + 1, the first position, the slot, a.
        table = device_tensor([r.tokens[len(r.tokens) - a - 1:] + [0] * (k1 - a - 1) + [r.kv_len - a - 1, r.slot, a]
                               for r, a in zip(rows, accepted)], device)
        positions = table[:, k1, None] + torch.arange(k1, device=device)[None]
        num_keys = max(r.kv_len - a - 1 for r, a in zip(rows, accepted)) + k1
        self._extend(table[:, k1 + 1], table[:, :k1], hidden, positions, table[:, k1 + 2], num_keys)

    def verify_extend(self, rows, hidden: torch.Tensor, chosen: torch.Tensor, accepted: torch.Tensor,
                      start: torch.Tensor, slots: torch.Tensor) -> None:
        """on_verify's extend, launched from the verify's device tensors before the step's read-back, so the host's
        bookkeeping after the read-back does not hold the device up (SGLang's EAGLE worker also runs its draft
        extend from the verify's device output). Row i verified positions start[i]..start[i]+k; its committed
        tokens are chosen[i, :a+1] (a = accepted[i]); the positions past them get the rejected drafts, whose keys
        the next draft chain overwrites before it reads them. Rows finished by this step are extended too: their
        slot is rewritten from its next request's prefill."""
        k1 = hidden.shape[1]
        positions = start[:, None] + torch.arange(k1, device=hidden.device)[None]
        num_keys = max(r.kv_len for r in rows) + k1  # the rows' lengths before this step's tokens
        self._extend(slots, chosen, hidden, positions, accepted, num_keys)
        self._draft_ahead(rows, slots, start + accepted + 1, num_keys)

    def _draft_ahead(self, rows, slots: torch.Tensor, lengths: torch.Tensor, longest: int) -> None:
        """The next step's greedy chain, queued right after the extend and before the read-back, from device
        tensors alone (`lengths`: each row's length once this step's tokens are in; `longest` bounds them): the
        device drafts while the host does the step's bookkeeping, as SGLang's overlap schedule drafts ahead. The
        next `sample_draft` takes it if it asks for the same k for rows it covers (`_take_ahead`); anything that
        changes a row's draft state first (a catch-up, a plain step's defer, a prefill, a new cache) drops it. Only
        where the chain is one captured graph (CUDA): elsewhere drafting ahead saves nothing."""
        self.ahead = None
        whole = self.target.graphs.get(mtp_chain_name(self.num_steps)) if self.num_steps else None
        if whole is None or not whole.capture_graphs or not whole.serves(self.cache, lengths[:, None],
                                                                        longest + self.num_steps - 1):
            return
        drafts = whole(lengths[:, None], lengths[:, None], slots, longest + self.num_steps - 1,
                       prev_hidden=self.next_hidden[slots][:, None])
        self.ahead = (list(rows), self.num_steps, drafts)

    def _take_ahead(self, rows) -> torch.Tensor | None:
        """The drafts `_draft_ahead` queued for these rows at this k, or None (then the caller drafts)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead[1] != self.num_steps:
            return None
        drafted_rows, _, drafts = ahead
        where = {id(r): i for i, r in enumerate(drafted_rows)}
        index = [where.get(id(r)) for r in rows]
        if None in index:
            return None
        if index == list(range(len(drafted_rows))):
            return drafts
        return drafts[device_tensor(index, drafts.device)]

    def defer(self, rows, hidden: torch.Tensor, positions: list[int]) -> None:
        """Queue a plain step for the next draft's batched extend: row i's step read position positions[i], whose
        target hidden state is hidden[i, 0], and committed rows[i].tokens[-1]. The overlap schedule calls this
        when it reads a step back, by which time the row's kv_len already counts the next step in flight."""
        self._step_id += 1
        self.ahead = None
        self.pending_steps[self._step_id] = (hidden[:, :1], {r.slot: i for i, r in enumerate(rows)},
                                             [r.tokens[-1] for r in rows], positions)
        for r in rows:
            waiting = self.pending.get(r.slot)
            if waiting is None:
                self.pending[r.slot] = [self._step_id]
            else:
                waiting.append(self._step_id)

    def weight_runner(self) -> dict[str, torch.nn.Parameter]:
        """SGLang's MTP draft runner (MiMoMTP, Glm4MoeForCausalLMNextN, DeepseekV3ForCausalLMNextN) loads the MTP layers
        plus the embedding and lm_head it shares with the target."""
        params = dict(self.target.named_parameters(remove_duplicate=False))
        names = [n for n in hf_weight_names(self.target) if self.target.is_mtp_weight(n)]
        names += ["model.embed_tokens.weight"] + ([] if self.target.args.tie_word_embeddings else ["lm_head.weight"])
        return {n: params[n] for n in names}
