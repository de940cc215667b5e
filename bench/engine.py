"""Embedded engine throughput: does speculation pay? Plain decoding vs speculative settings, side by side.

    python bench/engine.py [--quick] [--regimes NAME ...] [--eagle3-topk K ...] [--device cpu|cuda] [--repeats N]
                           [--batches 1,8,32] [--model-cache DIR] [--out FILE]
    python bench/engine.py --step-costs --mtp-model outputs/demo/model_sft --mtp-prompts outputs/demo/data/eval.jsonl

`--mtp-model` measures the trained-MTP rows on an existing checkpoint (the demo's) instead of training one;
`--step-costs` prints only what one step of fixed k = 1..3 over a plain step costs per batch size, and where a k = 3
step's time goes (draft / verify / sampling).

Regimes (each with its own target, its own plain row, and the ratio to it per batch size):
- exact draft (the ceiling): a random Qwen2 target whose last layers are identity, drafted by STANDALONE with a
  model made of its first layers (bench/engine_models.make_exact_pair): every draft is accepted, at a fraction
  of the target's cost. Greedy, random prompts.
- trained MTP (the realistic case): a MiMo target (hidden 256, 8 layers; the demo's is 128 wide, 12 deep),
  SFT-trained on the scratchpad task inside the bench, its MTP layer then trained on the target's own sampled
  outputs with the trunk frozen, unrolled over the 3 steps it drafts (as --mtp-unroll-steps 3); held-out prompts,
  temperature 1 (RL rollout), EOS on. NEXTN with SGLang's greedy drafting at 1-3 steps, with drafting by
  sampling (`--spec-draft-sampling`), with SGLang's `--speculative-adaptive` and with our `--spec-auto`.
- trained EAGLE3: a Llama target (llama3 RoPE) SFT-trained the same way, then an EAGLE3 draft head trained on
  the target's own sampled outputs (the training-time-test loss online training uses); held-out prompts,
  temperature 1. EAGLE3 chains (eagle-topk 1) at 1-3 steps, and trees for each `--eagle3-topk` entry > 1
  (5 steps, 4 * topk draft tokens: 16 at topk 4, 32 at topk 8); a row the embedded engine refuses (trees, for
  now) is skipped with the doctor's reason printed.
- never accepted (the floor): a random MiMo target with its random MTP layer, and STANDALONE with an
  "anti-draft" (the target with its lm_head negated drafts the target's argmin); fixed, adaptive and auto k.
- NGRAM on repetitive text.
Every engine row drives EngineCore in-process: all requests are added, then step() runs until the batch is done;
tokens/s counts generated tokens over wall time, prefill included. Each engine first runs the workload once
untimed (so adaptive/auto start warm, as in a long-running server); then the rows of a regime and batch size run
in turn, `--repeats` times, and each row reports its median. Accept length = tokens per verify pass (accepted
drafts + 1; plain steps that adaptive/auto chose are not verify passes).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

if not __package__:  # `python bench/<name>.py`: import bench as a package, from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import publish
from bench.engine_models import make_anti_draft, make_exact_pair, trained_eagle3_model, trained_mtp_model
from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
from slime_spec.rollout.data import read_jsonl
from slime_spec.speculative.settings import resolve, resolve_or_raise
from slime_spec.tools.tiny_model import full_vocab_size, make_tiny_model
from slime_spec.tools.tiny_tokenizer import CHARACTERS

REPETITIVE = ["the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat",
              "1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3",
              "abc def abc def abc def abc def abc def abc",
              "to be or not to be, to be or not to be, to be or"]
MIMO = {"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1}
REGIMES = ("exact", "mtp", "eagle3", "floor", "ngram")  # --regimes: exact draft, trained MTP, trained EAGLE3, ...
QUICK_REGIMES = ("exact", "mtp", "eagle3")
EAGLE3_TREE_STEPS = 5  # the seeds' EAGLE3 configuration drafts 5 steps (topk 8, 32 draft tokens)


@dataclass
class Setting:
    """One row: a speculative configuration of the engine (spec None = plain decoding)."""

    method: str
    server_args: dict | None = None
    draft_sampling: bool = False
    spec_auto: bool = False


@dataclass
class Regime:
    """A target, its workload and the rows measured on it."""

    name: str
    model: Path
    prompts: list[list[int]]
    params: SamplingParams
    settings: list[Setting]
    target_config: dict | None = None


@dataclass
class Row:
    regime: str
    method: str
    batch: int
    tokens_per_s: list[float] = field(default_factory=list)
    accept_length: float | None = None
    base: float | None = None  # median tokens/s of plain decoding in the same regime and batch

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s)


def nextn(steps: int, **extra) -> dict:
    return {"speculative_algorithm": "NEXTN", "speculative_num_steps": steps, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": steps + 1, **extra}


def standalone(draft: Path, steps: int = 3) -> dict:
    return {"speculative_algorithm": "STANDALONE", "speculative_num_steps": steps, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": steps + 1, "speculative_draft_model_path": str(draft)}


def eagle3(draft: Path, steps: int, topk: int = 1) -> dict:
    """EAGLE3 server args: a chain of `steps` drafts (topk 1), or a tree of 4 * topk draft tokens."""
    tokens = steps + 1 if topk == 1 else 4 * topk
    return {"speculative_algorithm": "EAGLE3", "speculative_num_steps": steps, "speculative_eagle_topk": topk,
            "speculative_num_draft_tokens": tokens, "speculative_draft_model_path": str(draft)}


def refusal(s: Setting, target_config: dict | None) -> str | None:
    """Why the embedded engine would refuse this row (the doctor's errors), or None when it serves it."""
    if s.server_args is None:
        return None
    _, findings = resolve(s.server_args, target_config=target_config, backend="embedded")
    errors = [str(f) for f in findings if f.level == "error"]
    return "; ".join(errors) or None


def servable(settings: list[Setting], target_config: dict | None, regime: str) -> list[Setting]:
    """The rows the engine serves; each refused one is named with the reason (e.g. trees before they land)."""
    kept = []
    for s in settings:
        why = refusal(s, target_config)
        if why:
            print(f"[bench] {regime}: skipping '{s.method}': {why}", flush=True)
        else:
            kept.append(s)
    return kept


def make_engine(regime: Regime, s: Setting, batch: int, device: str, dtype: str) -> EngineCore:
    spec = None if s.server_args is None else resolve_or_raise(s.server_args, target_config=regime.target_config)
    return EngineCore(str(regime.model), spec, dtype=dtype, device=device, max_running_requests=batch,
                      draft_sampling=s.draft_sampling, spec_auto=s.spec_auto)


def run_batch(core: EngineCore, prompts: list[list[int]], params: SamplingParams,
              tag: str) -> tuple[float, int, int, int]:
    """(seconds, generated tokens, verify passes, accepted drafts) for one batch run to completion."""
    for i, ids in enumerate(prompts):
        core.add_request(Request(f"{tag}-{i}", ids, params))
    outs = []
    sync(core.device.type)
    start = time.perf_counter()
    while core.has_work():
        outs += core.step()
    sync(core.device.type)
    elapsed = time.perf_counter() - start
    return (elapsed, sum(o.completion_tokens for o in outs), sum(o.spec_verify_ct for o in outs),
            sum(o.spec_accept_token_num for o in outs))


def sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def measure(regime: Regime, batches: list[int], repeats: int, device: str, dtype: str) -> list[Row]:
    """Every setting of the regime at every batch size, the settings interleaved within each repeat."""
    rows = []
    for b in batches:
        prompts = [regime.prompts[i % len(regime.prompts)] for i in range(b)]
        engines = [make_engine(regime, s, b, device, dtype) for s in regime.settings]
        for core in engines:
            run_batch(core, prompts, regime.params, "warmup")
        batch_rows = [Row(regime.name, s.method, b) for s in regime.settings]
        accepted, verifies = [0] * len(engines), [0] * len(engines)
        for rep in range(repeats):
            for i, core in enumerate(engines):
                seconds, n, v, acc = run_batch(core, prompts, regime.params, f"r{rep}")
                batch_rows[i].tokens_per_s.append(n / seconds)
                accepted[i], verifies[i] = accepted[i] + acc, verifies[i] + v
        for i, row in enumerate(batch_rows):
            row.accept_length = (accepted[i] + verifies[i]) / verifies[i] if verifies[i] else None
            row.base = batch_rows[0].median
        rows += batch_rows
        print(to_markdown(batch_rows), flush=True)
    return rows


def random_prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [tokenizer.encode("".join(rng.choice(CHARACTERS[:60]) for _ in range(length)), add_special_tokens=False)
            for _ in range(n)]


def jsonl_prompts(model: Path, path: Path) -> list[list[int]]:
    """The `prompt` field of every line of a JSONL file (the demo's data), tokenized as the rollout does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    return [tok.encode(row["prompt"], add_special_tokens=False) for row in read_jsonl(path)]


def regimes(tmp: Path, a: argparse.Namespace, quick: bool) -> list[Regime]:
    """The regimes named by --regimes, in REGIMES order (each builds or loads its own models)."""
    from transformers import AutoTokenizer

    hidden, layers = a.hidden_size, a.num_layers
    shape = dict(hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2, intermediate_size=hidden * 3,
                 max_position_embeddings=512)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=a.max_new_tokens, ignore_eos=True)
    rollout = SamplingParams(temperature=1.0, max_new_tokens=128)
    exact_target, exact_draft = make_exact_pair(tmp, shape, a.draft_layers)
    tok = AutoTokenizer.from_pretrained(str(exact_target))
    randoms = random_prompts(tok, 32, 48, seed=0)
    out = []
    if "exact" in a.regimes:
        out.append(Regime(f"exact draft ({a.draft_layers} of {layers} layers)", exact_target, randoms, greedy,
                          [Setting("plain"), Setting("STANDALONE k=3", standalone(exact_draft))]))
    if "mtp" in a.regimes:
        demo_shape = dict(hidden_size=a.mtp_hidden_size, num_layers=a.mtp_num_layers, num_heads=4, num_kv_heads=2,
                          intermediate_size=a.mtp_hidden_size * 3, max_position_embeddings=512)
        if a.mtp_model:  # an existing checkpoint, e.g. the demo's outputs/demo/model_sft, on its own eval prompts
            trained, eval_prompts = Path(a.mtp_model), jsonl_prompts(Path(a.mtp_model), Path(a.mtp_prompts))
        else:
            trained, eval_prompts = trained_mtp_model(Path(a.model_cache), demo_shape, digits=2,
                                                      sft_steps=a.sft_steps, mtp_steps=a.mtp_steps)
        mtp_rows = [Setting("plain")] + [Setting(f"NEXTN k={k}", nextn(k)) for k in ([2] if quick else [1, 2, 3])]
        mtp_rows += [Setting(f"NEXTN k={k} draft sampling", nextn(k), draft_sampling=True)
                     for k in ([2] if quick else [2, 3])]
        mtp_rows += [Setting("NEXTN adaptive, draft sampling", nextn(3, speculative_adaptive=True),
                             draft_sampling=True),
                     Setting("NEXTN auto k<=3", nextn(3), spec_auto=True),
                     Setting("NEXTN auto k<=3, draft sampling", nextn(3), draft_sampling=True, spec_auto=True)]
        out.append(Regime("trained MTP, temperature 1", trained, eval_prompts, rollout, mtp_rows, MIMO))
    if "eagle3" in a.regimes:
        out.append(eagle3_regime(a, quick, rollout))
    if "floor" in a.regimes or "ngram" in a.regimes:
        target = make_tiny_model(tmp / "target", arch="qwen2", seed=0, **shape)
    if "floor" in a.regimes:
        mimo = make_tiny_model(tmp / "mimo", arch="mimo", seed=1, init_from=str(target), **shape)
        anti = make_anti_draft(target, tmp / "anti", shape)
        out.append(Regime("never accepted", mimo, randoms, greedy, [
            Setting("plain"), Setting("STANDALONE anti-draft k=3", standalone(anti)),
            Setting("NEXTN random MTP k=3", nextn(3)),
            Setting("NEXTN random MTP adaptive", nextn(3, speculative_adaptive=True)),
            Setting("NEXTN random MTP auto k<=3", nextn(3), spec_auto=True)], MIMO))
    if "ngram" in a.regimes:
        repetitive = [tok.encode(t, add_special_tokens=False) for t in REPETITIVE]
        out.append(Regime("ngram, repetitive text", target, repetitive, greedy, [
            Setting("plain"), Setting("NGRAM 3 drafts", {"speculative_algorithm": "NGRAM",
                                                         "speculative_num_draft_tokens": 4})]))
    return out


def step_costs(model: Path, prompts: list[list[int]], batches: list[int], device: str, dtype: str,
               steps: int = 20, repeats: int = 3) -> str:
    """Per-step cost of fixed NEXTN k = 1..3 over plain decoding at each batch size (temperature 1, EOS off, the
    same prompts; median of interleaved repeats, process CPU time so other processes on a shared machine weigh
    less), and where a k = 3 step's time goes (engine/speculative: StepTimes)."""
    clock = time.thread_time if device == "cpu" else time.perf_counter
    params = SamplingParams(temperature=1.0, max_new_tokens=4 * steps + 16, ignore_eos=True)  # no row finishes
    lines = ["| batch | plain ms/step | k=1 / plain | k=2 / plain | k=3 / plain | k=3: draft | verify | sampling |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    regime = Regime("step costs", model, prompts, params, [], MIMO)
    for b in batches:
        settings = [Setting("plain")] + [Setting(f"k={k}", nextn(k)) for k in (1, 2, 3)]
        engines = [make_engine(regime, s, b, device, dtype) for s in settings]
        per_step: list[list[float]] = [[] for _ in engines]
        for rep in range(repeats + 1):  # the first pass warms up
            for i, core in enumerate(engines):
                for j in range(b):
                    core.add_request(Request(f"c{rep}-{j}", prompts[j % len(prompts)], params))
                core.step()  # prefill
                if i == 3:
                    core.spec_worker.times = type(core.step_times)()
                sync(device)
                start = clock()
                for _ in range(steps):
                    core.step()
                sync(device)
                if rep:
                    per_step[i].append((clock() - start) / steps)
                core.abort_all()
                while core.has_work():
                    core.step()
        plain = statistics.median(per_step[0])
        t = engines[3].step_times
        total = t.draft_s + t.verify_s + t.sampling_s
        lines.append(f"| {b} | {plain * 1e3:.2f} | " + " | ".join(f"{statistics.median(c) / plain:.2f}"
                                                                 for c in per_step[1:]) +
                     f" | {t.draft_s / total:.0%} | {t.verify_s / total:.0%} | {t.sampling_s / total:.0%} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def eagle3_regime(a: argparse.Namespace, quick: bool, params: SamplingParams) -> Regime:
    """A trained Llama + its EAGLE3 draft: plain, chains (topk 1) at 1-3 steps, then one tree per --eagle3-topk > 1."""
    shape = dict(hidden_size=a.eagle3_hidden_size, num_layers=a.eagle3_num_layers, num_heads=4, num_kv_heads=2,
                 intermediate_size=a.eagle3_hidden_size * 3, max_position_embeddings=512)
    target, draft, eval_prompts = trained_eagle3_model(Path(a.model_cache), shape, digits=2, sft_steps=a.sft_steps,
                                                       draft_steps=a.eagle3_draft_steps)
    rows = [Setting("plain")]
    for topk in a.eagle3_topk:
        if topk == 1:
            rows += [Setting(f"EAGLE3 chain k={k}", eagle3(draft, k)) for k in ([3] if quick else [1, 2, 3])]
        else:
            args = eagle3(draft, EAGLE3_TREE_STEPS, topk)
            rows.append(Setting(f"EAGLE3 tree topk={topk}, {args['speculative_num_draft_tokens']} draft tokens", args))
    config = json.loads((target / "config.json").read_text())
    name = "trained EAGLE3, temperature 1"
    return Regime(name, target, eval_prompts, params, servable(rows, config, name), config)


def describe(a: argparse.Namespace) -> list[str]:
    """The models and workloads of the regimes run, for the table's header."""
    parts = []
    if {"exact", "floor", "ngram"} & set(a.regimes):
        parts.append(f"random targets hidden {a.hidden_size}, {a.num_layers} layers, greedy, "
                     f"{a.max_new_tokens} new tokens")
    if "mtp" in a.regimes:
        parts.append(f"trained MTP target {a.mtp_model}" if a.mtp_model else
                     f"trained MTP target hidden {a.mtp_hidden_size}, {a.mtp_num_layers} layers ({a.sft_steps} SFT "
                     f"steps, {a.mtp_steps} MTP steps)")
    if "eagle3" in a.regimes:
        parts.append(f"trained EAGLE3 target (Llama) hidden {a.eagle3_hidden_size}, {a.eagle3_num_layers} layers "
                     f"({a.sft_steps} SFT steps, {a.eagle3_draft_steps} EAGLE3 draft steps)")
    if {"mtp", "eagle3"} & set(a.regimes):
        parts.append("trained targets: held-out 2-digit scratchpad prompts, temperature 1, up to 128 new tokens")
    return parts


def to_markdown(rows: list[Row]) -> str:
    lines = ["| regime | method | batch | tokens/s (median) | accept length | vs plain |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        acc = f"{r.accept_length:.2f}" if r.accept_length is not None else "-"
        ratio = f"{r.median / r.base:.2f}x" if r.base else "-"
        lines.append(f"| {r.regime} | {r.method} | {r.batch} | {r.median:.1f} | {acc} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="exact-draft, trained-MTP and trained-EAGLE3 regimes only, fewer rows, batches 1 and 8, "
                        "one repeat")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (CUDA default) | float16")
    p.add_argument("--hidden-size", type=int, default=256, help="random targets (exact draft, floor, ngram)")
    p.add_argument("--num-layers", type=int, default=8, help="random targets (exact draft, floor, ngram)")
    p.add_argument("--draft-layers", type=int, default=2, help="the exact draft's layers (first of the target's)")
    p.add_argument("--mtp-hidden-size", type=int, default=256, help="the trained target (the demo's model: 128)")
    p.add_argument("--mtp-num-layers", type=int, default=8, help="the trained target (the demo's model: 6)")
    p.add_argument("--sft-steps", type=int, default=150, help="target SFT steps on the scratchpad task")
    p.add_argument("--mtp-steps", type=int, default=100, help="MTP steps on the target's own outputs")
    p.add_argument("--mtp-model", default=None,
                   help="measure the trained-MTP rows on this MiMo checkpoint instead of training one (e.g. "
                        "outputs/demo/model_sft); needs --mtp-prompts")
    p.add_argument("--mtp-prompts", default=None,
                   help="JSONL with a `prompt` field per line (outputs/demo/data/eval.jsonl)")
    p.add_argument("--step-costs", action="store_true",
                   help="only the per-step cost of k = 1..3 over plain on the trained-MTP target (and its phases)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32; --quick 1,8)")
    p.add_argument("--eagle3-hidden-size", type=int, default=256, help="the trained EAGLE3 target (a Llama)")
    p.add_argument("--eagle3-num-layers", type=int, default=8, help="the trained EAGLE3 target (a Llama)")
    p.add_argument("--eagle3-draft-steps", type=int, default=100, help="EAGLE3 draft steps on the target's outputs")
    p.add_argument("--eagle3-topk", type=int, nargs="+", default=[1, 4, 8],
                   help="EAGLE3 rows: 1 = chains at 1-3 steps; K > 1 = a tree of 4K draft tokens over 5 steps "
                        "(skipped, with the reason, while the engine refuses trees)")
    p.add_argument("--regimes", nargs="+", choices=REGIMES, default=None,
                   help=f"which regimes to run (default all; --quick: {' '.join(QUICK_REGIMES)})")
    p.add_argument("--model-cache", default="outputs/bench_engine_models",
                   help="trained checkpoints are kept here by their settings; reruns skip training")
    p.add_argument("--max-new-tokens", type=int, default=None, help="greedy regimes (default 64, --quick 32)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per row, interleaved (default 3; quick 1)")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    a = p.parse_args(argv)
    a.max_new_tokens = a.max_new_tokens or (32 if a.quick else 64)
    if a.mtp_model and not a.mtp_prompts:
        p.error("--mtp-model needs --mtp-prompts (a JSONL file with a `prompt` field per line)")
    a.regimes = a.regimes or list(QUICK_REGIMES if a.quick else REGIMES)
    if a.step_costs:
        a.regimes = ["mtp"]
    if any(k < 1 for k in a.eagle3_topk):
        p.error(f"--eagle3-topk {a.eagle3_topk}: each entry is 1 (a chain) or more (a tree)")
    batches = [int(b) for b in a.batches.split(",")] if a.batches else ([1, 8] if a.quick else [1, 8, 32])
    repeats = a.repeats or (1 if a.quick else 3)
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="bench_engine_"))
    if a.step_costs:
        model = next(r for r in regimes(tmp, a, quick=True) if r.name.startswith("trained MTP"))
        print(step_costs(model.model, model.prompts, batches, a.device, dtype, repeats=repeats))
        return 0
    rows = []
    for regime in regimes(tmp, a, a.quick):
        rows += measure(regime, batches, repeats, a.device, dtype)
    header = (f"Embedded engine, speculative vs plain: {a.device} {dtype}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, vocab {full_vocab_size()}; " + "; ".join(describe(a)) +
              f"; median of {repeats} interleaved runs.")
    publish(header + "\n\n" + to_markdown(rows), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
