"""History drafting (issue #16): accept length, rollout time and drafting cost per RL step, side by side.

    python bench/history.py [--quick] [--steps N] [--methods ...] [--max-tokens N ...] [--out FILE]

Task: the demo's scratchpad addition (slime_spec/demo/task.py: "347+589=" answered column by column, ~100
tokens), every prompt sampled n times per step and again every step (one step is one epoch), so answers repeat
across epochs with variation. Policy: the demo's tiny MiMo (6 layers + 1 MTP layer, hidden 128, character
tokenizer) after a brief bench-local SFT of the policy and its MTP layer (cached under --sft-dir), so answers
follow the template. Online: after every step one real GRPO update (group-normalized scratchpad reward, one
Adam step on the policy; the MTP layer stays as SFT left it) computed from the plain run's rollouts; every other
method replays the same parameters per step, so all methods roll out the same policy.

Methods: plain; ngram (NGRAM, its n-gram cache shared across requests as SGLang's trie is: what a GRPO group
already gets with no history); history-group / history-epochs / history-both (NGRAM plus the group's siblings /
the prompt's earlier rollouts / both, through the same HistorySync the rollout manager uses, corpus calls
in-process); mtp (NEXTN with the MTP layer); mtp+history (NEXTN with history: the hybrid drafter). Accept length
= generated tokens / verify passes; rollout time = wall time of the step's batch; draft ms = time inside the
drafter per engine step. One greedy row per group is checked equal to plain decoding (lossless).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from slime_spec.demo.task import split_problems
from slime_spec.engine.drafters.history import HistoryRef
from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
from slime_spec.engine.model_executor.model import CausalLM, hf_weight_names, load_model
from slime_spec.rollout.history import HistoryStore
from slime_spec.rollout.history_sync import REQUEST_EXTENSION, HistorySync
from slime_spec.rollout.sample import Sample
from slime_spec.rollout.scratchpad import scratchpad_reward
from slime_spec.speculative.settings import resolve_or_raise
from slime_spec.tools.tiny_model import make_tiny_model

METHODS = ("plain", "ngram", "history-group", "history-epochs", "history-both", "mtp", "mtp+history")
MODEL = dict(hidden_size=128, num_layers=6, intermediate_size=384, num_heads=4, num_kv_heads=2)
QUICK_MODEL = dict(hidden_size=64, num_layers=2, intermediate_size=128, num_heads=4, num_kv_heads=2)


@dataclass
class StepRow:
    method: str
    step: int
    max_tokens: int
    rollout_s: float
    accept_length: float
    tokens: int
    draft_ms_per_step: float
    reward: float


# ---------------------------------------------------------------- policy: brief SFT, then GRPO updates
def _batch(seqs: list[list[int]], starts: list[int], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] and a mask of the positions whose next token is trained (the response's)."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.zeros(len(seqs), width - 1)
    for i, (s, st) in enumerate(zip(seqs, starts)):
        mask[i, st - 1:len(s) - 1] = 1
    return ids, mask


def _trunk(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    return model.eager_forward(ids, positions, model.new_cache(len(ids), ids.shape[1]), torch.arange(len(ids)))


def token_logprobs(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) for every t: [B, T - 1]."""
    logits = model.logits(_trunk(model, ids)[:, :-1])
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def mtp_loss(model: CausalLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The MTP layer at position p reads (x_{p+1}, h_p) and predicts x_{p+2} (trunk hidden detached)."""
    hidden = _trunk(model, ids).detach()
    positions = torch.arange(ids.shape[1] - 1)[None].expand(len(ids), -1)
    out = model.eager_mtp_forward(ids[:, 1:], hidden[:, :-1], positions,
                                  model.new_mtp_cache(len(ids), ids.shape[1]), torch.arange(len(ids)))
    logits = model.logits(out[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten(), reduction="none").view_as(mask[:, 1:])
    return (loss * mask[:, 1:]).sum() / mask[:, 1:].sum()


def sft(model_dir: Path, out: Path, rows: list[dict], steps: int, batch: int, seed: int) -> Path:
    """A brief SFT of the policy and its MTP layer on the reference solutions, written as an HF checkpoint."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model, _ = load_model(model_dir)
    model.train().requires_grad_(True)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    data = [(tok.encode(r["prompt"], add_special_tokens=False),
             tok.encode(r["label"], add_special_tokens=False) + [tok.eos_token_id]) for r in rows]
    for step in range(steps):
        pick = rng.sample(data, batch)
        ids, mask = _batch([p + a for p, a in pick], [len(p) for p, _ in pick], tok.eos_token_id)
        lp = token_logprobs(model, ids)
        loss = -(lp * mask).sum() / mask.sum() + mtp_loss(model, ids, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            print(f"  sft step {step}: loss {loss.item():.3f}", flush=True)
    params = dict(model.named_parameters(remove_duplicate=False))
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({n: params[n].detach().contiguous() for n in hf_weight_names(model)}, str(out / "model.safetensors"))
    return out


def grpo_update(model: CausalLM, opt: torch.optim.Optimizer, samples: list[Sample], n: int) -> None:
    """One GRPO step: advantage = reward minus the group mean over the group std; loss -A * mean log p(response)."""
    rewards = torch.tensor([s.reward for s in samples]).view(-1, n)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    ids, mask = _batch([s.tokens for s in samples], [s.prompt_length for s in samples], 0)
    lp = token_logprobs(model, ids)
    loss = -(adv[:, None] * lp * mask).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


# ---------------------------------------------------------------- rollout under each method
class InProcessCorpora:
    """The engine's real corpus calls (what /add_external_corpus does after tokenizing), without HTTP."""

    url = "in-process"

    def __init__(self, core: EngineCore):
        self.core = core

    async def add_external_corpus(self, corpus_id: str, documents: list[str]) -> dict:
        chunks = [self.core.tokenizer.encode(d, add_special_tokens=False) for d in documents]
        return {"loaded_token_count": self.core.drafter.add_corpus(corpus_id, [c for c in chunks if c])}

    async def remove_external_corpus(self, corpus_id: str) -> dict:
        self.core.drafter.remove_corpus(corpus_id)
        return {}


def time_drafter(drafter) -> list[float]:
    """Accumulate the seconds spent inside the drafter's hooks (outermost call only: propose may call
    sample_draft). The wrappers are instance attributes, which shadow the class's methods."""
    spent, depth = [0.0], [0]
    for name in ("on_prefill", "propose", "sample_draft", "on_verify"):
        fn = getattr(drafter, name, None)
        if fn is None:
            continue

        def timed(*a, _fn=fn, **kw):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[0] += time.perf_counter() - t0

        setattr(drafter, name, timed)
    return spent


def make_engine(method: str, model: str, args) -> EngineCore:
    spec = None
    if method.startswith("mtp"):
        spec = resolve_or_raise({"speculative_algorithm": "NEXTN", "speculative_num_steps": args.draft_tokens - 1,
                                 "speculative_eagle_topk": 1, "speculative_num_draft_tokens": args.draft_tokens})
    elif method != "plain":
        spec = resolve_or_raise({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": args.draft_tokens})
    return EngineCore(model, spec, device=args.device, max_running_requests=args.batch, seed=args.seed,
                      spec_auto=args.spec_auto and spec is not None)


def run_method(method: str, model: str, prompts: list[dict], policies: list[dict], args, max_tokens: int,
               trainer=None) -> tuple[list[StepRow], dict]:
    """Roll out every step under `method`; with `trainer` (plain only) each step's GRPO update is recorded."""
    core = make_engine(method, model, args)
    sync = None
    if "history" in method:
        group = method in ("history-group", "history-both", "mtp+history")
        epochs = method in ("history-epochs", "history-both", "mtp+history")
        sync = HistorySync(HistoryStore(args.epochs, max_tokens), "embedded", corpus_max_tokens=10_000_000,
                           use_group=group, use_epochs=epochs)
    spent = time_drafter(core.drafter) if core.drafter is not None else [0.0]
    rows, greedy_out = [], {}
    for step in range(args.steps):
        if trainer is not None:
            policies.append({n: p.detach().clone() for n, p in trainer[0].named_parameters()})
        params = dict(core.model.named_parameters())
        with torch.no_grad():
            for name, value in policies[step].items():
                params[name].copy_(value)
        samples = []
        for g, row in enumerate(prompts):
            ids = core.tokenizer.encode(row["prompt"], add_special_tokens=False)
            for _ in range(args.n):
                samples.append(Sample(index=len(samples), group_index=g, prompt=row["prompt"], label=row["label"],
                                      tokens=list(ids)))
        if sync is not None:
            asyncio.run(sync.before_rollout([InProcessCorpora(core)], samples, step))
        spent[0], engine_steps = 0.0, 0
        start = time.perf_counter()
        for s in samples:
            temp = 0.0 if s.index % args.n == 0 else args.temperature  # one greedy row per group: lossless check
            ext = s.metadata.get(REQUEST_EXTENSION, {}).get("slime_history")
            core.add_request(Request(str(s.index), list(s.tokens),
                                     SamplingParams(temperature=temp, max_new_tokens=args.max_new),
                                     history=HistoryRef(**ext) if ext else None))
        outs = {}
        while core.has_work():
            outs.update({o.rid: o for o in core.step()})
            engine_steps += 1
        elapsed = time.perf_counter() - start
        for s in samples:
            o = outs[str(s.index)]
            s.tokens += o.output_ids
            s.response, s.response_length = o.text, len(o.output_ids)
            s.reward = scratchpad_reward(o.text, s.label)
            if s.index % args.n == 0:
                greedy_out[(step, s.index)] = o.output_ids
        if sync is not None:
            sync.after_rollout(samples, step)
        if trainer is not None:
            grpo_update(*trainer, samples, args.n)
        tokens = sum(o.completion_tokens for o in outs.values())
        verifies = sum(o.spec_verify_ct for o in outs.values())
        reward = sum(s.reward for s in samples) / len(samples)
        rows.append(StepRow(method, step, max_tokens, elapsed, tokens / verifies if verifies else 1.0, tokens,
                            1000 * spent[0] / max(engine_steps, 1), reward))
        print(f"{method:14s} step {step}: {elapsed:6.2f}s  accept {rows[-1].accept_length:.2f}  "
              f"draft {rows[-1].draft_ms_per_step:.2f} ms/step  tokens {tokens}  reward {reward:.3f}", flush=True)
    return rows, greedy_out


def sft_checkpoint(args) -> Path:
    """The SFT'd policy for these settings, trained once and reused from --sft-dir."""
    size = QUICK_MODEL if args.quick else MODEL
    key = hashlib.blake2b(json.dumps([size, args.sft_steps, args.seed]).encode(), digest_size=6).hexdigest()
    out = Path(args.sft_dir) / key
    if (out / "model.safetensors").exists():
        return out
    base = make_tiny_model(out.with_name(key + "-init"), arch="mimo", mtp_layers=1, max_position_embeddings=256,
                           seed=args.seed, **size)
    train, _ = split_problems(2000, 0, args.seed, 3)
    print(f"[bench] brief SFT ({args.sft_steps} steps) -> {out}", flush=True)
    return sft(base, out, train, args.sft_steps, 32, args.seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 layers, hidden 64, 4 prompts x 4: a smoke run")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--draft-tokens", type=int, default=8, help="tokens per verify (k + 1), every method")
    ap.add_argument("--spec-auto", action="store_true",
                    help="--spec-auto for every speculative method: k per step from measured costs, up to the above")
    ap.add_argument("--epochs", type=int, default=1, help="--rollout-history-epochs")
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[8192],
                    help="--rollout-history-max-tokens; several values sweep the history methods")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-4, help="GRPO learning rate (Adam)")
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--sft-dir", default="outputs/bench_history")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    args = ap.parse_args()
    num_prompts, args.n, args.max_new = (4, 4, 128) if args.quick else (8, 8, 128)
    args.batch = num_prompts * args.n
    model = str(sft_checkpoint(args))
    prompts = split_problems(num_prompts, 0, args.seed + 1, 3)[0]
    policy, _ = load_model(model)
    policy.train().requires_grad_(True)
    for p in policy.model.mtp_layers.parameters():
        p.requires_grad_(False)
    trainer = (policy, torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=args.lr))
    policies: list[dict] = []
    results, greedy = [], {}
    methods = ["plain"] + [m for m in args.methods if m != "plain"]  # plain records the policy of every step
    for method in methods:
        sweep = args.max_tokens if "history" in method else args.max_tokens[:1]
        for max_tokens in sweep:
            rows, greedy[(method, max_tokens)] = run_method(method, model, prompts, policies, args, max_tokens,
                                                            trainer if method == "plain" else None)
            results += rows
    base = greedy[("plain", args.max_tokens[0])]
    for key, out in greedy.items():
        if out != base:
            raise SystemExit(f"{key}: greedy rows differ from plain decoding (drafting must be lossless)")
    print("\n| method | max tokens | step 0 s | step 0 accept | last step s | last step accept | total s | "
          "draft ms/step | speed-up (total) |")
    print("|---|---|---|---|---|---|---|---|---|")
    plain_total = sum(r.rollout_s for r in results if r.method == "plain")
    for (method, max_tokens) in greedy:
        rows = [r for r in results if r.method == method and r.max_tokens == max_tokens]
        total = sum(r.rollout_s for r in rows)
        draft = sum(r.draft_ms_per_step for r in rows) / len(rows)
        print(f"| {method} | {max_tokens if 'history' in method else '-'} | {rows[0].rollout_s:.2f} | "
              f"{rows[0].accept_length:.2f} | {rows[-1].rollout_s:.2f} | {rows[-1].accept_length:.2f} | "
              f"{total:.2f} | {draft:.2f} | {plain_total / total:.2f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
