"""The embedded engine on one GPU: plain decode against the memory roofline and transformers, then speculative
decoding with a briefly trained MTP draft, NGRAM, and adaptive/auto draft lengths, side by side in one run.

    python bench/engine_gpu.py                  # 0.7B Llama layout (hidden 1536, 24 layers), bf16
    python bench/engine_gpu.py --quick          # a small model, to check the script

1. Roofline: bytes of weights (+ KV read per token) / the measured device-to-device copy bandwidth.
2. Plain decode tokens/s at batch 1/8/32, CUDA graphs on and off, and transformers' generate on the same
   checkpoint (eager, dynamic cache).
3. Speculative rows at batch 1/8/32/128 on a MiMo copy of the target (same base tensors + one MTP layer). The MTP
   layer is trained inside the bench on the target's own greedy outputs (trunk frozen), so its accept length is
   what a draft that learned this target reaches; NGRAM drafts from the prompt and every request's tokens.
Every row decodes `--new-tokens` tokens per request (ignore_eos) from random prompts; tokens/s counts generated
tokens over wall time, prefill included; ratios are to plain decoding at the same batch, measured in the same run
with repeats interleaved.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from slime_spec.engine.core import EngineCore, Request, SamplingParams
from slime_spec.engine.cuda_graph import CudaGraphSettings
from slime_spec.spec import SpecConfig, resolve_or_raise
from slime_spec.tiny_model import make_tiny_model

SHAPES = {"full": dict(hidden_size=1536, num_layers=24, num_heads=12, num_kv_heads=2, intermediate_size=4096),
          "quick": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512)}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a device-to-device copy of 1 GiB."""
    x = torch.empty(1 << 29 if device.type == "cuda" else 1 << 24, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    return 2 * x.numel() * x.element_size() * 10 / (time.perf_counter() - t)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def run(core: EngineCore, batch: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(tokens/s, accept length) for one batch decoded to completion."""
    sync()
    t = time.perf_counter()
    for i, ids in enumerate(batch):
        core.add_request(Request(rid=str(i), input_ids=ids, params=SamplingParams(
            temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)))
    verify = accepted = 0
    while core.has_work():
        for o in core.step():
            verify += o.spec_verify_ct
            accepted += o.spec_accept_token_num
    sync()
    seconds = time.perf_counter() - t
    return len(batch) * new_tokens / seconds, (accepted + verify) / verify if verify else 1.0


def run_long_tail(core: EngineCore, batch: list[list[int]], lengths: list[int]) -> tuple[float, float]:
    """A rollout-shaped batch: request i decodes lengths[i] tokens. Returns (total seconds, the share of it spent
    after 90% of the requests had finished: the long tail)."""
    sync()
    t = time.perf_counter()
    for i, (ids, n) in enumerate(zip(batch, lengths)):
        core.add_request(Request(rid=str(i), input_ids=ids, params=SamplingParams(
            temperature=0.0, max_new_tokens=n, ignore_eos=True)))
    done, t90 = 0, None
    while core.has_work():
        done += len(core.step())
        if t90 is None and done >= 0.9 * len(batch):
            sync()
            t90 = time.perf_counter()
    sync()
    total = time.perf_counter() - t
    return total, (total - (t90 - t)) / total


def train_mtp(core: EngineCore, batch: list[list[int]], new_tokens: int, steps: int, lr: float) -> float:
    """Train the MTP layer on the target's own greedy continuations of `batch` (trunk frozen); returns the last
    loss. The MTP layer at position p reads (x_{p+1}, h_p) and predicts x_{p+2}, as the engine drafts."""
    model = core.model
    model.unfuse_projections()  # train the separate parameters (the fused matmuls would bypass their gradients)
    for i, ids in enumerate(batch):
        core.add_request(Request(rid=f"t{i}", input_ids=ids, params=SamplingParams(
            temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)))
    seqs = {}
    while core.has_work():
        seqs.update({o.rid: o.output_ids for o in core.step()})
    tokens = torch.tensor([ids + seqs[f"t{i}"] for i, ids in enumerate(batch)], device=core.device)
    n, length = tokens.shape
    positions = torch.arange(length, device=core.device)[None].expand(n, length)
    slots = torch.arange(n, device=core.device)
    with torch.no_grad():
        hidden = model.eager_forward(tokens, positions, model.new_cache(n, length), slots)
    mtp = model.model.mtp_layers[0]
    params = [p for p in mtp.parameters()]
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=lr, weight_decay=0.0)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        for p, m in zip(params, master):
            p.data.copy_(m.detach())
            p.requires_grad_(True)
            p.grad = None
        out = model.eager_mtp_forward(tokens[:, 1:-1], hidden[:, :-2], positions[:, :-2],
                                      model.new_mtp_cache(n, length), slots)
        logits = model.lm_head(out).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten())
        loss.backward()
        for p, m in zip(params, master):
            m.grad = p.grad.float()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        for p, m in zip(params, master):
            p.data.copy_(m)
            p.requires_grad_(False)
    return loss.item()  # `core` stays unfused (training only); the rows below load these weights into fresh engines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--plain-batches", default="1,8,32")
    p.add_argument("--spec-batches", default="1,8,32,128")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", default="cuda", help="cpu only to check the script (no graphs there)")
    p.add_argument("--torch-compile", action="store_true",
                   help="also time plain decoding with --enable-torch-compile, and run the speculative rows with it")
    p.add_argument("--tail-requests", type=int, default=64, help="requests in the long-tailed rollout")
    p.add_argument("--skip-plain", action="store_true", help="skip the plain-decode table (speculative rows only)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    shape = SHAPES["quick" if a.quick else "full"]
    plain_b = [int(x) for x in a.plain_batches.split(",")]
    spec_b = [int(x) for x in a.spec_batches.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="engine_gpu_"))
    llama = make_tiny_model(tmp / "llama", arch="llama", mtp_layers=0, vocab_size=a.vocab, dtype="bfloat16",
                            max_position_embeddings=1024, **shape)
    mimo = make_tiny_model(tmp / "mimo", arch="mimo", mtp_layers=1, vocab_size=a.vocab, dtype="bfloat16",
                           max_position_embeddings=1024, init_from=str(llama), **shape)
    bw = copy_bandwidth(dev)
    graphs = CudaGraphSettings(batch_sizes=tuple(sorted(set(plain_b + spec_b))))
    compiled_graphs = CudaGraphSettings(batch_sizes=graphs.batch_sizes, torch_compile=True,
                                        torch_compile_max_bs=max(spec_b))
    ctx = a.prompt_len + a.new_tokens + 8

    def engine(path, spec=None, cuda_graph=None, **kw):
        cuda_graph = cuda_graph or (compiled_graphs if a.torch_compile and spec is not None else graphs)
        core = EngineCore(str(path), spec, dtype="bfloat16", device=a.device, max_running_requests=max(spec_b),
                          context_length=ctx, cuda_graph=cuda_graph, **kw)
        return core

    plain = engine(llama)
    nbytes = sum(t.numel() * t.element_size() for t in plain.model.state_dict().values())
    a_ = plain.model.args
    kv_per_token = 2 * a_.num_layers * a_.num_kv_heads * a_.head_dim * 2 * (a.prompt_len + a.new_tokens // 2)
    roofline_s = (nbytes + kv_per_token) / bw
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    print(f"\n{name}, bf16, hidden {a_.hidden_size}, {a_.num_layers} layers, "
          f"{nbytes / 1e9:.2f} GB of weights; copy bandwidth {bw / 1e12:.2f} TB/s (read + written); "
          f"roofline at batch 1 {roofline_s * 1e3:.3f} ms/token = {1 / roofline_s:,.0f} tokens/s; "
          f"graph capture {plain.graph_capture_seconds:.1f} s")
    if a.skip_plain:
        plain_b = []
    eager = engine(llama, cuda_graph=CudaGraphSettings(disable=True))
    compiled = engine(llama, cuda_graph=compiled_graphs) if a.torch_compile else None
    if compiled is not None:
        print(f"graph capture with --enable-torch-compile (one decoder layer compiled): "
              f"{compiled.graph_capture_seconds:.1f} s")
    rows = []
    for b in plain_b:
        batch = prompts(b, a.prompt_len, a.vocab, seed=b)
        for core in (plain, eager, compiled):
            if core is not None:
                run(core, batch, 8)  # warm-up
        g, e, c = [], [], []
        for _ in range(a.repeats):
            g.append(run(plain, batch, a.new_tokens)[0])
            e.append(run(eager, batch, min(a.new_tokens, 32))[0])
            if compiled is not None:
                c.append(run(compiled, batch, a.new_tokens)[0])
        rows.append((b, max(g), max(e), max(c) if c else None))
    hf = {}
    if a.transformers and plain_b:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.bfloat16).to(dev).eval()
        for b in (1, max(plain_b)):
            ids = torch.tensor(prompts(b, a.prompt_len, a.vocab, seed=b), device=dev)
            gen = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0)
            model.generate(ids, **{**gen, "max_new_tokens": 8, "min_new_tokens": 8})
            sync()
            t = time.perf_counter()
            model.generate(ids, **gen)
            sync()
            hf[b] = b * a.new_tokens / (time.perf_counter() - t)
        del model
    print("\n| batch | engine eager tok/s | CUDA graphs tok/s | graphs + torch.compile tok/s | best ms/step "
          "| best x roofline (batch 1) | transformers generate tok/s | best / transformers |")
    print("|---|---|---|---|---|---|---|---|")
    for b, g, e, c in rows:
        best = max(g, c or 0.0)
        share = f"{(1 / best) / roofline_s:.2f}x" if b == 1 else ""
        ref = hf.get(b)
        print(f"| {b} | {e:,.0f} | {g:,.0f} | {'' if c is None else f'{c:,.0f}'} | {1e3 * b / best:.3f} | {share} | "
              f"{'' if ref is None else f'{ref:,.0f}'} | {'' if ref is None else f'{best / ref:.1f}x'} |")
    del eager, compiled

    # ---- speculative rows on the MiMo copy, MTP layer trained on the target's own outputs
    base = engine(mimo)
    loss = train_mtp(base, prompts(64, a.prompt_len, a.vocab, seed=1234), a.new_tokens, a.train_steps, 1e-3)
    trained = {n: t.detach().clone() for n, t in base.model.state_dict().items() if "mtp_layers" in n}
    print(f"\nMTP layer trained {a.train_steps} steps on 64 greedy continuations: final loss {loss:.3f}")
    eagle = lambda k: SpecConfig("EAGLE", k, 1, k + 1)  # noqa: E731
    configs = {"plain": (None, {}), "EAGLE k=1": (eagle(1), {}), "EAGLE k=3": (eagle(3), {}),
               "EAGLE k=3, adaptive": (SpecConfig("EAGLE", 3, 1, 4, speculative_adaptive=True), {}),
               "EAGLE k=3, --spec-auto": (eagle(3), {"spec_auto": True}),
               "NGRAM 4 tokens": (resolve_or_raise({"speculative_algorithm": "NGRAM",
                                                       "speculative_num_draft_tokens": 4}), {})}
    cores = {}
    for name, (spec, kw) in configs.items():
        core = engine(mimo, spec, **kw)
        if core.drafter is not None and getattr(core.drafter, "target", None) is core.model:  # the MTP drafter
            core.load_weights(list(trained.items()), selector="all")
        cores[name] = core
    results = {name: {} for name in configs}
    for b in spec_b:
        batch = prompts(b, a.prompt_len, a.vocab, seed=100 + b)
        for core in cores.values():
            run(core, batch, 8)
        for r in range(a.repeats):
            order = list(cores.items()) if r % 2 == 0 else list(reversed(cores.items()))
            for name, core in order:
                tps, acc = run(core, batch, a.new_tokens)
                best = results[name].get(b)
                if best is None or tps > best[0]:
                    results[name][b] = (tps, acc)
    print("\n| method | " + " | ".join(f"batch {b}: tok/s (accept) vs plain" for b in spec_b) + " |")
    print("|---|" + "---|" * len(spec_b))
    for name, by_b in results.items():
        cells = []
        for b in spec_b:
            tps, acc = by_b[b]
            cells.append(f"{tps:,.0f} ({acc:.2f}) {tps / results['plain'][b][0]:.2f}x")
        print(f"| {name} | " + " | ".join(cells) + " |")

    # ---- a rollout-shaped batch: most responses short, a few 10x longer
    n = min(a.tail_requests, max(spec_b))
    torch.manual_seed(7)  # the same lengths in every run
    lengths = [max(8, min(10 * a.new_tokens, int(x))) for x in
               torch.distributions.LogNormal(torch.log(torch.tensor(a.new_tokens / 4.0)), 0.9).sample((n,)).tolist()]
    tail_ctx = a.prompt_len + max(lengths) + 8
    batch = prompts(n, a.prompt_len, a.vocab, seed=777)
    print(f"\nlong-tailed rollout: {n} requests, response lengths median {sorted(lengths)[n // 2]}, "
          f"max {max(lengths)} tokens\n")
    print("| method | total s | vs plain | share of time after 90% of requests finished |")
    print("|---|---|---|---|")
    tail = {}
    for name in ("plain", "EAGLE k=3", "EAGLE k=3, adaptive", "EAGLE k=3, --spec-auto", "NGRAM 4 tokens"):
        spec, kw = configs[name]
        core = EngineCore(str(mimo), spec, dtype="bfloat16", device=a.device, max_running_requests=max(spec_b),
                          context_length=tail_ctx, cuda_graph=compiled_graphs if a.torch_compile and spec else graphs,
                          **kw)
        if core.drafter is not None and getattr(core.drafter, "target", None) is core.model:
            core.load_weights(list(trained.items()), selector="all")
        run(core, batch[:4], 8)
        tail[name] = run_long_tail(core, batch, lengths)
        del core
        print(f"| {name} | {tail[name][0]:.2f} | {tail['plain'][0] / tail[name][0]:.2f}x | {tail[name][1]:.0%} |",
              flush=True)


if __name__ == "__main__":
    main()
