"""Embedded engine throughput: plain decoding vs each speculative algorithm, with transformers as the peer.

    python bench/engine.py [--quick] [--device cpu|cuda] [--out FILE]

One random checkpoint (Qwen2 layout, hidden 256, 4 layers by default) is the target everywhere; a MiMo
copy of it (same base tensors plus one random MTP layer) serves EAGLE. Random weights accept nothing
by chance, so three regimes bound what speculation can do:
- upper bound: STANDALONE with the target as its own draft (every draft token is accepted);
- NGRAM on repetitive text (drafts copied from the request's own tokens);
- lower bound: drafts that are never accepted: STANDALONE with an "anti-draft" (the target with its
  lm_head negated, so it drafts the target's least likely token) and EAGLE with a random MTP layer.
  (A small random draft is no lower bound: random tiny models collapse onto the same few tokens.)
Every engine row drives EngineCore in-process (as transformers' generate runs in-process): all
requests are added, then step() runs until the batch is done; tokens/s counts generated tokens over
the wall time, prefill included. Accept length = generated tokens / verify passes.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from slime_spec.engine.core import EngineCore, Request, SamplingParams, SpecConfig
from slime_spec.spec import resolve_or_raise
from slime_spec.tiny_model import CHARACTERS, full_vocab_size, make_tiny_model

REPETITIVE = ["the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat",
              "1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3",
              "abc def abc def abc def abc def abc def abc",
              "to be or not to be, to be or not to be, to be or"]


@dataclass
class Row:
    method: str
    regime: str
    prompts: str
    batch: int
    tokens_per_s: float
    accept_length: float | None
    base: float | None = None  # tokens/s of plain decoding on the same prompts and batch


def random_prompts(n: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = CHARACTERS[:60]
    return ["".join(rng.choice(letters) for _ in range(length)) for _ in range(n)]


def batch_of(prompts: list[str], batch: int) -> list[str]:
    return [prompts[i % len(prompts)] for i in range(batch)]


def run_engine(core: EngineCore, texts: list[str], max_new: int, tag: str) -> tuple[float, float | None]:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    for i, t in enumerate(texts):
        core.add_request(Request(f"{tag}-{i}", core.tokenizer.encode(t), params))
    outs = []
    sync(core.device.type)
    start = time.perf_counter()
    while core.has_work():
        outs += core.step()
    sync(core.device.type)
    elapsed = time.perf_counter() - start
    tokens = sum(o.completion_tokens for o in outs)
    verify = sum(o.spec_verify_ct for o in outs)
    return tokens / elapsed, (tokens / verify if verify else None)


def sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def engine_rows(name: str, regime: str, model: Path, spec: SpecConfig | None, prompt_sets: dict, batches: list[int],
                max_new: int, device: str, dtype: str, repeats: int) -> list[Row]:
    core = EngineCore(str(model), spec, dtype=dtype, device=device, max_running_requests=max(batches))
    run_engine(core, batch_of(next(iter(prompt_sets.values())), 2), 8, "warmup")
    rows = []
    for label, prompts in prompt_sets.items():
        for b in batches:
            runs = [run_engine(core, batch_of(prompts, b), max_new, f"{name}-{label}-{b}-{i}") for i in range(repeats)]
            rows.append(Row(name, regime, label, b, max(r[0] for r in runs), runs[0][1]))
    return rows


def hf_rows(model: Path, prompt_sets: dict, batches: list[int], max_new: int, device: str, dtype: str,
            repeats: int) -> list[Row]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch_dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.padding_side = "left"
    common = dict(do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=tok.pad_token_id)

    def timed(texts: list[str], **kw) -> float:
        return max(timed_once(texts, **kw) for _ in range(repeats))

    def timed_once(texts: list[str], **kw) -> float:
        enc = tok(texts, return_tensors="pt", padding=True).to(device)
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(**enc, **common, **kw)
        sync(device)
        return (out.shape[0] * (out.shape[1] - enc["input_ids"].shape[1])) / (time.perf_counter() - start)

    timed(["warm up"])
    rows = []
    for label, prompts in prompt_sets.items():
        for b in batches:
            rows.append(Row("transformers generate", "plain", label, b, timed(batch_of(prompts, b)), None))
        # assisted generation and prompt lookup run one sequence at a time in transformers
        rows.append(Row("transformers assisted", "draft == target", label, 1,
                        timed(prompts[:1], assistant_model=hf), None))
        rows.append(Row("transformers prompt lookup", "ngram", label, 1,
                        timed(prompts[:1], prompt_lookup_num_tokens=3), None))
    return rows


def make_anti_draft(target: Path, out: Path, shape: dict) -> Path:
    """The target with an untied, negated lm_head: its greedy draft is the target's argmin, never accepted."""
    from safetensors.torch import load_file, save_file

    make_tiny_model(out, arch="qwen2", seed=0, init_from=str(target), tie_word_embeddings=False, **shape)
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"] = -load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def to_markdown(rows: list[Row], header: str) -> str:
    lines = [header, "", "| method | regime | prompts | batch | tokens/s | accept length | vs plain |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        acc = f"{r.accept_length:.2f}" if r.accept_length is not None else "-"
        ratio = f"{r.tokens_per_s / r.base:.2f}x" if r.base else "-"
        lines.append(f"| {r.method} | {r.regime} | {r.prompts} | {r.batch} | {r.tokens_per_s:.1f} | {acc} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller model, fewer tokens, batches 1 and 8")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (CUDA default) | float16")
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None,
                   help="best of N timings per row (default: 3 on CUDA, 2 on CPU, 1 with --quick)")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers peer rows")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    a = p.parse_args(argv)
    hidden = a.hidden_size or (128 if a.quick else 256)
    layers = a.num_layers or (2 if a.quick else 4)
    max_new = a.max_new_tokens or (32 if a.quick else 128)
    batches = [1, 8] if a.quick else [1, 8, 32]
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="bench_engine_"))
    shape = dict(hidden_size=hidden, num_layers=layers, num_heads=max(4, hidden // 64), num_kv_heads=2,
                 intermediate_size=hidden * 3, max_position_embeddings=1024)
    target = make_tiny_model(tmp / "target", arch="qwen2", seed=0, **shape)
    mimo = make_tiny_model(tmp / "mimo", arch="mimo", seed=1, init_from=str(target), tie_word_embeddings=True,
                           **shape)
    anti = make_anti_draft(target, tmp / "anti", shape)
    prompt_sets = {"random": random_prompts(32, 48, seed=0), "repetitive": REPETITIVE}
    repeats = a.repeats or (1 if a.quick else 3 if a.device == "cuda" else 2)
    eng = dict(prompt_sets=prompt_sets, batches=batches, max_new=max_new, device=a.device, dtype=dtype, repeats=repeats)
    rows = engine_rows("plain", "-", target, None, **eng)
    base = {(r.prompts, r.batch): r.tokens_per_s for r in rows}
    rows += engine_rows("STANDALONE", "draft == target", target,
                        SpecConfig("STANDALONE", 3, 1, 4, speculative_draft_model_path=str(target)), **eng)
    rows += engine_rows("NGRAM", "ngram", target, resolve_or_raise({"speculative_algorithm": "NGRAM",
                                                                  "speculative_num_draft_tokens": 4}), **eng)
    rows += engine_rows("STANDALONE", "anti-draft", target,
                        SpecConfig("STANDALONE", 3, 1, 4, speculative_draft_model_path=str(anti)), **eng)
    rows += engine_rows("EAGLE (MTP)", "random draft", mimo, SpecConfig("EAGLE", 3, 1, 4), **eng)
    if not a.no_transformers:
        rows += hf_rows(target, prompt_sets, batches, max_new, a.device, dtype, repeats)
    for r in rows:
        r.base = base.get((r.prompts, r.batch))
    header = (f"Embedded engine vs transformers: random Qwen2 checkpoint, hidden {hidden}, {layers} layers, "
              f"vocab {full_vocab_size()}, {a.device} {dtype}, greedy, {max_new} new tokens per "
              f"request, speculative chain of 3 draft tokens (NGRAM: 3), best of {repeats}, torch {torch.__version__}.")
    table = to_markdown(rows, header)
    print(table)
    if a.out:
        Path(a.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
