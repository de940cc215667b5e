"""History drafting (issue #16): accept length and rollout time per RL step, side by side in one run.

    python bench/history.py [--quick] [--device cpu|cuda] [--steps N] [--out FILE]

Task: step-by-step arithmetic ("37+58: 7+8=15, carry 1; 3+5+1=9; answer 95"), every prompt of the dataset
sampled n times per step and again every step (one step is one epoch), so answers repeat across epochs with
variation. The policy changes every step: each parameter gets seeded Gaussian noise (a stand-in for an online
GRPO update, identical for every method). Every method drives EngineCore in-process through the same
HistorySync the rollout manager uses (corpus calls go straight to the drafter, no HTTP).

Methods: plain decoding; ngram (NGRAM with its n-gram cache shared across requests, as SGLang's trie is: what
SGLang already gives a GRPO group, no history); history-group (siblings of the group, running or finished);
history-epochs (the prompt's earlier rollouts only); history-both. Accept length = generated tokens / verify
passes; rollout time = wall time of the step's batch. Lossless drafting changes the time, never the
distribution; greedy rows are checked equal to plain decoding.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from slime_spec.engine.core import EngineCore, Request, SamplingParams
from slime_spec.engine.drafters.history import HistoryRef
from slime_spec.rollout.history import HistoryStore
from slime_spec.rollout.history_sync import REQUEST_EXTENSION, HistorySync
from slime_spec.rollout.sample import Sample
from slime_spec.spec import resolve_or_raise
from slime_spec.tiny_model import make_tiny_model

METHODS = ("plain", "ngram", "history-group", "history-epochs", "history-both")


@dataclass
class StepRow:
    method: str
    step: int
    rollout_s: float
    accept_length: float
    tokens: int


def arithmetic_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append(f"{a}+{b}: {a % 10}+{b % 10}={a % 10 + b % 10}, carry {(a % 10 + b % 10) // 10}; "
                   f"{a // 10}+{b // 10}+{(a % 10 + b % 10) // 10}=")
    return out


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


def perturb(core: EngineCore, step: int, scale: float) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in core.model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p) * scale * (p.std() if p.numel() > 1 else 1.0))


def run_method(method: str, model: str, prompts: list[str], args) -> tuple[list[StepRow], dict]:
    spec = None if method == "plain" else resolve_or_raise({"speculative_algorithm": "NGRAM",
                                                            "speculative_num_draft_tokens": args.draft_tokens})
    core = EngineCore(model, spec, device=args.device, max_running_requests=args.batch, seed=args.seed)
    sync = None
    if method.startswith("history"):
        store = HistoryStore(args.epochs, args.max_tokens)
        sync = HistorySync(store, "embedded", corpus_max_tokens=10_000_000,
                           use_group=method in ("history-group", "history-both"),
                           use_epochs=method in ("history-epochs", "history-both"))
    rows, greedy_out = [], {}
    for step in range(args.steps):
        perturb(core, step, args.policy_noise)
        samples = []
        for p_i, text in enumerate(prompts):
            ids = core.tokenizer(text)["input_ids"]
            for k in range(args.n):
                s = Sample(index=len(samples), group_index=p_i, prompt=text, tokens=list(ids))
                samples.append(s)
        if sync is not None:
            asyncio.run(sync.before_rollout([InProcessCorpora(core)], samples, step))
        start = time.perf_counter()
        for s in samples:
            temp = 0.0 if s.index % args.n == 0 else args.temperature  # one greedy row per group: lossless check
            ext = s.metadata.get(REQUEST_EXTENSION, {}).get("slime_history")
            core.add_request(Request(str(s.index), list(s.tokens),
                                     SamplingParams(temperature=temp, max_new_tokens=args.max_new, ignore_eos=True),
                                     history=HistoryRef(**ext) if ext else None))
        outs = {}
        while core.has_work():
            outs.update({o.rid: o for o in core.step()})
        elapsed = time.perf_counter() - start
        for s in samples:
            o = outs[str(s.index)]
            s.tokens += o.output_ids
            s.response, s.response_length = o.text, len(o.output_ids)
            if s.index % args.n == 0:
                greedy_out[(step, s.index)] = o.output_ids
        if sync is not None:
            sync.after_rollout(samples, step)
        tokens = sum(o.completion_tokens for o in outs.values())
        verifies = sum(o.spec_verify_ct for o in outs.values())
        rows.append(StepRow(method, step, elapsed, tokens / verifies if verifies else 1.0, tokens))
        print(f"{method:15s} step {step}: {elapsed:7.2f}s  accept {rows[-1].accept_length:.2f}", flush=True)
    return rows, greedy_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="hidden 128, 2 layers, 4 prompts x 4, 32 new tokens")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--draft-tokens", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=1, help="--rollout-history-epochs")
    ap.add_argument("--max-tokens", type=int, default=8192, help="--rollout-history-max-tokens")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--policy-noise", type=float, default=0.02, help="per-step noise, x each parameter's std")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    args = ap.parse_args()
    hidden, layers = (128, 2) if args.quick else (256, 4)
    num_prompts, args.n, args.max_new = (4, 4, 32) if args.quick else (8, 8, 96)
    args.batch = num_prompts * args.n
    prompts = arithmetic_prompts(num_prompts, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "m", hidden_size=hidden, num_layers=layers, seed=args.seed))
        results, greedy = [], {}
        for method in args.methods:
            rows, greedy[method] = run_method(method, model, prompts, args)
            results += rows
    if "plain" in greedy:
        for method, out in greedy.items():
            if out != greedy["plain"]:
                raise SystemExit(f"{method}: greedy rows differ from plain decoding (drafting must be lossless)")
    print("\n| method | step 0 s | step 0 accept | last step s | last step accept | total s |")
    print("|---|---|---|---|---|---|")
    for method in args.methods:
        rows = [r for r in results if r.method == method]
        print(f"| {method} | {rows[0].rollout_s:.2f} | {rows[0].accept_length:.2f} | {rows[-1].rollout_s:.2f} | "
              f"{rows[-1].accept_length:.2f} | {sum(r.rollout_s for r in rows):.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
