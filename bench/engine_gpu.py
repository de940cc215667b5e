"""The embedded engine on one GPU: plain decode against the memory roofline and transformers, then speculative
decoding with drafts trained briefly on the target's own outputs (MTP, a small STANDALONE draft), NGRAM,
adaptive/auto draft lengths and the exact-draft ceiling, side by side in one run.

    python bench/engine_gpu.py                  # 0.7B Llama layout (hidden 1536, 24 layers), bf16
    python bench/engine_gpu.py --quick --device cpu   # a small model, to check the script

1. Roofline: bytes of weights (+ KV read per token) / the measured device-to-device copy bandwidth.
2. Plain decode tokens/s at batch 1/8/32, CUDA graphs on and off, and transformers' generate on the same
   checkpoint: eager with its dynamic cache, and with a static cache (generate then compiles the decode step with
   torch.compile and CUDA graphs; CUDA only).
3. Speculative rows at batch 1/8/32/128 on a MiMo target (one MTP layer). --target scratchpad (the default): the
   target of the plain table's shape is first SFT-trained on the device on worked addition (the demo's task,
   1- to 5-digit operands), so its outputs carry structure a draft can learn, as an RL policy's do; the table
   decodes held-out --digits-digit problems greedily to EOS. --target random: the random MiMo copy of the plain
   table's target, every request --new-tokens long (drafts of it are almost never accepted: their cost).
   Two drafts learn the target inside the bench, on its greedy continuations of --train-prompts prompts: the MTP
   layer (trunk frozen) and a STANDALONE draft made of the target's first --draft-layers layers, embedding and
   lm_head (its layers trained). Both are distilled in float32 on the target's whole next-token distribution
   (soft cross-entropy), and the bench prints their top-1 agreement with the target on held-out continuations:
   the per-token accept rate to expect. NGRAM drafts from the prompt and every request's tokens.
   The ceiling: a random target whose layers from --draft-layers on are identity, drafted by STANDALONE with its
   first layers (bench/engine_models.make_exact_pair): every draft is accepted at the cost of those layers; it
   is compared with plain decoding of that target, on random prompts of --new-tokens tokens each.
4. A rollout-shaped batch: most responses short, a few several times longer; total time and the tail's share.
Tokens/s counts generated tokens over wall time, prefill included; ratios are to plain decoding at the same
batch, measured in the same run with repeats interleaved.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

if not __package__:  # `python bench/<name>.py`: import bench as a package, from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.engine_models import make_exact_pair, save_checkpoint, sft_target
from bench.step_profile_gpu import StepPhases
from slime_spec.demo.task import split_problems
from slime_spec.engine.kernels.ops import Kernels
from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings
from slime_spec.engine.model_executor.model import CausalLM, load_model
from slime_spec.speculative.settings import SpecConfig, resolve_or_raise
from slime_spec.tools.tiny_model import make_tiny_model

SHAPES = {"full": dict(hidden_size=1536, num_layers=24, num_heads=12, num_kv_heads=2, intermediate_size=4096),
          "quick": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512)}
# Flags left unset take these values: the full run, or --quick (a minute on a CPU, to check the script).
DEFAULTS = {"full": dict(vocab=32000, new_tokens=128, plain_batches="1,8,32", spec_batches="1,8,32,128", repeats=2,
                         tail_requests=64, train_steps=600, train_prompts=256, draft_layers=2, sft_steps=400),
            "quick": dict(vocab=4096, new_tokens=32, plain_batches="1,4", spec_batches="1,4", repeats=1,
                          tail_requests=8, train_steps=20, train_prompts=8, draft_layers=1, sft_steps=10)}


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


def run(core: EngineCore, batch: list[list[int]], new_tokens: int, ignore_eos: bool = True) -> tuple[float, float]:
    """(tokens/s, accept length) for one batch decoded to completion: generated tokens over wall time."""
    sync()
    t = time.perf_counter()
    for i, ids in enumerate(batch):
        core.add_request(Request(rid=str(i), input_ids=ids, params=SamplingParams(
            temperature=0.0, max_new_tokens=new_tokens, ignore_eos=ignore_eos)))
    verify = accepted = tokens = 0
    while core.has_work():
        for o in core.step():
            verify += o.spec_verify_ct
            accepted += o.spec_accept_token_num
            tokens += len(o.output_ids)
    sync()
    seconds = time.perf_counter() - t
    return tokens / seconds, (accepted + verify) / verify if verify else 1.0


def run_long_tail(core: EngineCore, batch: list[list[int]], lengths: list[int], ignore_eos: bool
                  ) -> tuple[float, float, int]:
    """A rollout-shaped batch: request i decodes at most lengths[i] tokens. Returns (total seconds, the share of it
    spent after 90% of the requests had finished: the long tail, tokens generated)."""
    sync()
    t = time.perf_counter()
    for i, (ids, n) in enumerate(zip(batch, lengths)):
        core.add_request(Request(rid=str(i), input_ids=ids, params=SamplingParams(
            temperature=0.0, max_new_tokens=n, ignore_eos=ignore_eos)))
    done, t90, tokens = 0, None, 0
    while core.has_work():
        finished = core.step()
        done += len(finished)
        tokens += sum(len(o.output_ids) for o in finished)
        if t90 is None and done >= 0.9 * len(batch):
            sync()
            t90 = time.perf_counter()
    sync()
    total = time.perf_counter() - t
    return total, (total - (t90 - t)) / total, tokens


# ---- the target: random, or trained on the scratchpad task (so its outputs have structure a draft can learn)
class ScratchpadTask:
    """Worked-addition problems (slime_spec.demo.task) for the trained target: training rows over 1..5-digit
    operands, and held-out prompts as token ids, handed out without repeats (`take`) so no row of the speculative
    table sees a prompt twice (NGRAM's cache keeps what it saw)."""

    def __init__(self, tokenizer, digits: int, seed: int = 0):
        encode = lambda rows: [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows]  # noqa: E731
        self.train_rows, self.held_out, self.trained_on = [], {}, {}
        for d in range(1, 6):
            train, evals = split_problems(90 if d == 1 else 3000, 10 if d == 1 else 1500 if d == digits else 100,
                                          seed + d, d)
            self.train_rows += train
            self.held_out[d], self.trained_on[d] = encode(evals), encode(train)
        self.digits, self._cursor = digits, 0

    def train_prompts(self, n: int, seed: int) -> list[list[int]]:
        """Prompts the target was trained on, every operand length alike: what the drafts learn from."""
        return random.Random(seed).sample([p for d in self.trained_on for p in self.trained_on[d]], n)

    def take(self, n: int) -> list[list[int]]:
        """The next n held-out prompts with --digits-digit operands."""
        pool = self.held_out[self.digits]
        if self._cursor + n > len(pool):
            raise ValueError(f"{n} more held-out {self.digits}-digit prompts asked for, {len(pool) - self._cursor} "
                             "left: fewer --repeats or smaller --spec-batches")
        self._cursor += n
        return pool[self._cursor - n:self._cursor]

    def mixed(self, n: int, seed: int) -> list[list[int]]:
        """n held-out prompts, most with short operands and a few with long ones: long-tailed response lengths
        (1-digit prompts come from all 100 such problems, the trained ones included: there are no more)."""
        rng = random.Random(seed)
        pools = {1: self.held_out[1] + self.trained_on[1], **{d: self.held_out[d] for d in range(2, 6)}}
        shares = {1: 0.5, 2: 0.25, 3: 0.12, 4: 0.08, 5: 0.05}
        return [rng.choice(pools[d]) for d in rng.choices(list(shares), list(shares.values()), k=n)]


def train_scratchpad_target(a, tmp: Path, shape: dict, task: ScratchpadTask) -> Path:
    """A MiMo of the bench's shape (one MTP layer, untrained here) SFT-trained on the scratchpad task on the
    device in float32 (TF32 matmuls on CUDA): the serving engines load it in bf16."""
    init = make_tiny_model(tmp / "scratchpad_init", arch="mimo", mtp_layers=1, vocab_size=a.vocab,
                           max_position_embeddings=1024, **shape)
    torch.backends.cuda.matmul.allow_tf32 = True
    t = time.perf_counter()
    model, _ = sft_target(init, task.train_rows, a.sft_steps, seed=0, device=a.device, lr=a.sft_lr,
                          batch=a.sft_batch)
    print(f"target SFT: {a.sft_steps} steps of {a.sft_batch} problems in {time.perf_counter() - t:.0f}s", flush=True)
    out = save_checkpoint(model.to(torch.bfloat16), init, tmp / "scratchpad_target")
    del model
    return out


# ---- drafts trained on the target's own outputs
@dataclass
class Corpus:
    """Prompts + the target's greedy continuations [n, T] (right-padded), the fp32 trunk's final-normed hidden
    states [n, T, H] (the MTP layer's input, and through the lm_head the teacher distribution at every position),
    and `valid` [n, T]: the positions whose next token is a continuation token, up to the first EOS."""
    tokens: torch.Tensor
    hidden: torch.Tensor
    valid: torch.Tensor


def greedy_corpus(core: EngineCore, teacher: CausalLM, batch: list[list[int]], new_tokens: int) -> Corpus:
    """The target's greedy continuations (stopping at EOS; an EOS-less target, the random one, writes new_tokens)."""
    for i, ids in enumerate(batch):
        core.add_request(Request(rid=f"c{i}", input_ids=ids, params=SamplingParams(
            temperature=0.0, max_new_tokens=new_tokens)))
    seqs = {}
    while core.has_work():
        seqs.update({o.rid: o.output_ids for o in core.step()})
    full = [ids + seqs[f"c{i}"] for i, ids in enumerate(batch)]
    length = max(map(len, full))
    tokens = torch.tensor([f + [0] * (length - len(f)) for f in full], device=core.device)
    pos = torch.arange(length, device=core.device)[None]
    starts = torch.tensor([len(ids) - 1 for ids in batch], device=core.device)[:, None]
    ends = torch.tensor([len(f) - 1 for f in full], device=core.device)[:, None]
    n = len(full)
    hidden = []
    with torch.no_grad():
        for rows in torch.arange(n, device=core.device).split(16):
            positions = pos.expand(len(rows), length)
            hidden.append(teacher(tokens[rows], positions, teacher.new_cache(len(rows), length),
                                  torch.arange(len(rows), device=core.device), num_keys=length))
    return Corpus(tokens, torch.cat(hidden), (pos >= starts) & (pos < ends))


def init_mtp_from_trunk(model: CausalLM) -> None:
    """Start the MTP layer as the target's first layer run on the next token: input_proj passes the token
    embedding through (the hidden-state half starts at zero), the decoder layer and final norm are the target's
    layer 0 and final norm. Its drafts then begin where a 1-layer truncation of the target is (a random MTP
    layer agrees with the target on no token); distillation then teaches it to use the hidden state too."""
    mtp, h = model.model.mtp_layers[0], model.args.hidden_size
    with torch.no_grad():
        mtp.load_state_dict(model.model.layers[0].state_dict(), strict=False)
        mtp.input_proj.weight.zero_()
        mtp.input_proj.weight[:, h:] = torch.eye(h)
        mtp.token_layernorm.weight.fill_(1.0)
        mtp.final_layernorm.weight.copy_(model.model.norm.weight)


def describe(corpus: Corpus) -> str:
    """How repetitive the target's continuations are: distinct tokens per continuation, and the share of next
    tokens that repeat what followed the current token's previous occurrence (what an n-gram draft copies)."""
    distinct, lengths, copied, total = [], [], 0, 0
    for seq, valid in zip(corpus.tokens.tolist(), corpus.valid.tolist()):
        first, end = valid.index(True), len(valid) - valid[::-1].index(True)
        distinct.append(len(set(seq[first + 1:end + 1])))
        lengths.append(end - first)
        last_next: dict[int, int] = {}
        for i in range(end):
            if i >= first:
                copied += last_next.get(seq[i]) == seq[i + 1]
                total += 1
            last_next[seq[i]] = seq[i + 1]
    distinct.sort()
    lengths.sort()
    return (f"{len(distinct)} continuations of {lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}):"
            f" median {distinct[len(distinct) // 2]} distinct tokens, {copied / max(total, 1):.0%} of next tokens "
            "repeat what followed the previous occurrence")


def mtp_student(model: CausalLM, corpus: Corpus, rows: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(MTP logits, teacher logits) [b, T-1, V] and where they count [b, T-1]: at position p the MTP layer reads
    (x_{p+1}, h_p) and predicts x_{p+2}, exactly as the engine drafts (drafters/mtp.py); the teacher is the
    target's distribution at p+1."""
    tokens, hidden = corpus.tokens[rows], corpus.hidden[rows]
    b, length = tokens.shape
    positions = torch.arange(length - 1, device=tokens.device)[None].expand(b, length - 1)
    out = model.eager_mtp_forward(tokens[:, 1:], hidden[:, :-1], positions, model.new_mtp_cache(b, length),
                                  torch.arange(b, device=tokens.device), num_keys=length - 1)
    with torch.no_grad():
        teacher = model.logits(hidden[:, 1:])
    return model.logits(out), teacher, corpus.valid[rows][:, 1:]


def standalone_student(draft: CausalLM, target: CausalLM, corpus: Corpus, rows: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draft logits, teacher logits) [b, T, V] and where they count [b, T]: the draft reads what the target
    reads."""
    tokens = corpus.tokens[rows]
    b, length = tokens.shape
    positions = torch.arange(length, device=tokens.device)[None].expand(b, length)
    hidden = draft(tokens, positions, draft.new_cache(b, length), torch.arange(b, device=tokens.device),
                   num_keys=length)
    with torch.no_grad():
        teacher = target.logits(corpus.hidden[rows])
    return draft.logits(hidden), teacher, corpus.valid[rows]


def agreement(student_teacher, corpus: Corpus) -> float:
    """Top-1 agreement with the target over the continuation positions: a greedy draft's per-token accept rate."""
    same = counted = 0
    with torch.no_grad():
        for rows in torch.arange(len(corpus.tokens), device=corpus.tokens.device).split(16):
            student, teacher, valid = student_teacher(corpus, rows)
            same += ((student.argmax(-1) == teacher.argmax(-1)) & valid).sum().item()
            counted += valid.sum().item()
    return same / counted


def distill(params: list[torch.nn.Parameter], student_teacher, corpus: Corpus, held_out: Corpus, steps: int,
            lr: float, batch: int, label: str) -> None:
    """Distil the target's own distribution (soft cross-entropy to its softmax at every position, not just its
    argmax: 32000 numbers per position instead of one, so the draft learns the target's function rather than
    memorising a few greedy continuations). AdamW, linear warm-up, cosine decay, gradient clipping."""
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.55 + 0.45 * math.cos(math.pi * min(1.0, s / steps))))
    before = agreement(student_teacher, held_out)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        rows = torch.randperm(len(corpus.tokens), generator=gen)[:batch].to(corpus.tokens.device)
        student, teacher, valid = student_teacher(corpus, rows)
        loss = -((teacher.softmax(-1) * student.log_softmax(-1)).sum(-1) * valid).sum() / valid.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    for p in params:
        p.requires_grad_(False)
    print(f"{label}: {steps} steps on {len(corpus.tokens)} greedy continuations, soft cross-entropy "
          f"{losses[0]:.2f} -> {losses[-1]:.2f}; top-1 agreement with the target on {len(held_out.tokens)} "
          f"held-out continuations {before:.1%} -> {agreement(student_teacher, held_out):.1%} "
          f"(train {agreement(student_teacher, corpus):.1%})", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--plain-batches", default=None)
    p.add_argument("--spec-batches", default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--train-steps", type=int, default=None, help="distillation steps per trained draft")
    p.add_argument("--train-prompts", type=int, default=None, help="greedy continuations the drafts learn from")
    p.add_argument("--train-batch", type=int, default=16, help="continuations per distillation step")
    p.add_argument("--train-lr", type=float, default=1e-3, help="peak AdamW learning rate of the distillation")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="layers of the trained STANDALONE draft and of the exact draft (the target's first layers)")
    p.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", default="cuda", help="cpu only to check the script (no graphs there)")
    p.add_argument("--torch-compile", action="store_true",
                   help="also time plain decoding with --enable-torch-compile, and run the speculative rows with it")
    p.add_argument("--tail-requests", type=int, default=None, help="requests in the long-tailed rollout")
    p.add_argument("--skip-plain", action="store_true", help="skip the plain-decode table (speculative rows only)")
    p.add_argument("--skip-speculative", action="store_true", help="the plain-decode table only")
    p.add_argument("--target", choices=("scratchpad", "random"), default="scratchpad",
                   help="the speculative rows' target: SFT-trained on worked addition inside the bench (outputs a "
                        "draft can learn), or random (drafts that are almost never accepted: their cost)")
    p.add_argument("--digits", type=int, default=4, help="operand digits of the speculative table's prompts")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT steps of the scratchpad target")
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--sft-lr", type=float, default=3e-4)
    p.add_argument("--rows", default=None, help="the speculative rows to run, names separated by ';' (with the plain "
                   "rows they are compared with; a STANDALONE draft is trained only for its row)")
    p.add_argument("--phases", action="store_true", help="split each row's last decode at the largest batch by step "
                   "kind: prefill, steps by k, steps under 64 rows, catch-ups (step_profile_gpu.StepPhases)")
    a = p.parse_args(argv)
    for flag, value in DEFAULTS["quick" if a.quick else "full"].items():
        if getattr(a, flag) is None:
            setattr(a, flag, value)
    dev = torch.device(a.device)
    shape = SHAPES["quick" if a.quick else "full"]
    plain_b = [int(x) for x in a.plain_batches.split(",")]
    spec_b = [int(x) for x in a.spec_batches.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="engine_gpu_"))
    llama = make_tiny_model(tmp / "llama", arch="llama", mtp_layers=0, vocab_size=a.vocab, dtype="bfloat16",
                            max_position_embeddings=1024, **shape)
    bw = copy_bandwidth(dev)
    graphs = CudaGraphSettings(batch_sizes=tuple(sorted(set(plain_b + spec_b))))
    compiled_graphs = CudaGraphSettings(batch_sizes=graphs.batch_sizes, torch_compile=True,
                                        torch_compile_max_bs=max(spec_b))
    ctx = a.prompt_len + a.new_tokens + 8

    def engine(path, cuda_graph=graphs, kernels=None):
        """A plain engine (the plain table's, and the one writing the drafts' training corpus); kernels None: the
        engine's default (its Triton gemv and decode attention on CUDA)."""
        return EngineCore(str(path), None, dtype="bfloat16", device=a.device, max_running_requests=max(spec_b),
                          context_length=ctx, cuda_graph=cuda_graph, kernels=kernels)

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
    # cuBLAS matmuls and SDPA attention (--bf16-gemm-backend torch --attention-backend torch_native), the engine's
    # path before its Triton kernels, beside the default
    torch_kernels = Kernels()
    cores = {"eager": engine(llama, cuda_graph=CudaGraphSettings(disable=True)), "graphs": plain,
             "graphs_torch": engine(llama, kernels=torch_kernels)}
    if a.torch_compile:
        cores["compiled"] = engine(llama, cuda_graph=compiled_graphs)
        cores["compiled_torch"] = engine(llama, cuda_graph=compiled_graphs, kernels=torch_kernels)
        print(f"graph capture with --enable-torch-compile (one decoder layer compiled): "
              f"{cores['compiled'].graph_capture_seconds:.1f} s")
    rows = []
    for b in plain_b:
        batch = prompts(b, a.prompt_len, a.vocab, seed=b)
        for core in cores.values():
            run(core, batch, 8)  # warm-up
        speeds = {name: [] for name in cores}
        for _ in range(a.repeats):
            for name, core in cores.items():
                speeds[name].append(run(core, batch, min(a.new_tokens, 32) if name == "eager" else a.new_tokens)[0])
        rows.append((b, {name: max(v) for name, v in speeds.items()}))
    hf = {}  # (batch, cache) -> tok/s; cache "dynamic" (eager generate) or "static" (static cache, auto-compiled)
    if a.transformers and plain_b:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.bfloat16).to(dev).eval()
        for b in (1, max(plain_b)):
            ids = torch.tensor(prompts(b, a.prompt_len, a.vocab, seed=b), device=dev)
            for cache in ("dynamic", "static") if dev.type == "cuda" else ("dynamic",):
                # a static cache makes generate compile the decode step (torch.compile, CUDA graphs); the first
                # call at the full length compiles and warms up, the timed ones reuse it
                gen = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0,
                           **({"cache_implementation": "static"} if cache == "static" else {}))
                model.generate(ids, **gen)
                best = 0.0
                for _ in range(a.repeats):
                    sync()
                    t = time.perf_counter()
                    model.generate(ids, **gen)
                    sync()
                    best = max(best, b * a.new_tokens / (time.perf_counter() - t))
                hf[b, cache] = best
        del model
    print("\n| batch | engine eager tok/s | CUDA graphs, cuBLAS + SDPA tok/s | CUDA graphs tok/s | graphs + compile, "
          "cuBLAS + SDPA tok/s | graphs + compile tok/s | kernels / cuBLAS + SDPA (best of each) | best ms/step "
          "| best x roofline (batch 1) | transformers generate tok/s | transformers static cache + compile tok/s "
          "| best / transformers (best of its two) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    cell = lambda v: "" if v is None else f"{v:,.0f}"  # noqa: E731
    for b, s in rows:
        best = max(s["graphs"], s.get("compiled", 0.0))
        before = max(s["graphs_torch"], s.get("compiled_torch", 0.0))
        share = f"{(1 / best) / roofline_s:.2f}x" if b == 1 else ""
        dyn, static = hf.get((b, "dynamic")), hf.get((b, "static"))
        ref = max(dyn or 0.0, static or 0.0)
        print(f"| {b} | {s['eager']:,.0f} | {s['graphs_torch']:,.0f} | {s['graphs']:,.0f} | "
              f"{cell(s.get('compiled_torch'))} | {cell(s.get('compiled'))} | {best / before:.2f}x | "
              f"{1e3 * b / best:.3f} | {share} | {cell(dyn)} | {cell(static)} | "
              f"{f'{best / ref:.1f}x' if ref else ''} |")
    del cores
    if a.skip_speculative:
        return

    # ---- speculative rows: drafts trained on the target's own outputs, NGRAM, and the exact-draft ceiling
    if a.target == "scratchpad":
        from transformers import AutoTokenizer

        task = ScratchpadTask(AutoTokenizer.from_pretrained(str(llama)), a.digits)
        target = train_scratchpad_target(a, tmp, shape, task)
        train_prompts, held_out = task.train_prompts(a.train_prompts, seed=1), task.mixed(8, seed=2)
        table_prompts = lambda n, seed: task.take(n)  # noqa: E731
        cap = 256  # responses end at EOS: 5-digit worked sums are about 215 tokens
    else:
        task = None
        target = make_tiny_model(tmp / "mimo", arch="mimo", mtp_layers=1, vocab_size=a.vocab, dtype="bfloat16",
                                 max_position_embeddings=1024, init_from=str(llama), **shape)
        train_prompts = prompts(a.train_prompts, a.prompt_len, a.vocab, seed=1234)
        held_out = prompts(8, a.prompt_len, a.vocab, seed=4321)
        table_prompts = lambda n, seed: prompts(n, a.prompt_len, a.vocab, seed)  # noqa: E731
        cap = a.new_tokens
    ctx = max(ctx, 16 + cap + 8)
    chosen = None if a.rows is None else a.rows.split(";")
    a.train_standalone = chosen is None or any(n.startswith("STANDALONE trained") for n in chosen)
    mtp_weights, trained_draft = train_drafts(a, target, tmp, engine(target), shape, train_prompts, held_out, cap)
    exact_target, exact_draft = make_exact_pair(tmp, {**shape, "vocab_size": a.vocab, "dtype": "bfloat16",
                                                      "max_position_embeddings": 1024}, a.draft_layers)
    rows = speculative_rows(target, trained_draft, exact_target, exact_draft, a.draft_layers)
    if chosen is not None:
        unknown = set(chosen) - set(rows)
        if unknown:
            raise SystemExit(f"--rows: no row named {sorted(unknown)}; the rows are {list(rows)}")
        rows = {n: r for n, r in rows.items() if n in chosen or n in {rows[c].baseline for c in chosen}}
    spec_graphs = compiled_graphs if a.torch_compile else graphs  # every row alike, plain included

    spec_engine = partial(serving_engine, device=a.device, max_running_requests=max(spec_b),
                          cuda_graph=spec_graphs, mtp_weights=mtp_weights)
    cores = {name: spec_engine(row, ctx) for name, row in rows.items()}
    results = {name: {} for name in rows}
    for b in spec_b:
        # New prompts per repeat (the same for every row of it): NGRAM's cache keeps what it saw, and the same
        # greedy prompt a second time would be drafted from its own earlier continuation.
        random_warm, warm = prompts(b, a.prompt_len, a.vocab, seed=100 + b), table_prompts(b, 100 + b)
        for name, core in cores.items():
            run(core, random_warm if rows[name].random_prompts else warm, 8)
        for r in range(a.repeats):
            seed = 100 + b + 1000 * (r + 1)
            batch, random_batch = table_prompts(b, seed), prompts(b, a.prompt_len, a.vocab, seed)
            order = list(cores.items()) if r % 2 == 0 else list(reversed(cores.items()))
            for name, core in order:
                phases = StepPhases() if a.phases and b == max(spec_b) and r == a.repeats - 1 else None
                with phases.watching(core) if phases else nullcontext():
                    if rows[name].random_prompts:  # the exact pair: random weights, every request a fixed length
                        tps, acc = run(core, random_batch, a.new_tokens)
                    else:
                        tps, acc = run(core, batch, cap, ignore_eos=task is None)
                if phases:
                    print(f"{name}, batch {b}: {tps:,.0f} tok/s\n" + "\n".join(phases.lines()), flush=True)
                best = results[name].get(b)
                if best is None or tps > best[0]:
                    results[name][b] = (tps, acc)
    what = (f"target SFT-trained on {a.digits}-digit worked addition, greedy to EOS" if task is not None else
            f"random target, {a.new_tokens} tokens per request")
    print(f"\nspeculative rows ({what}); tokens/s counts generated tokens over wall time")
    print("\n| method | " + " | ".join(f"batch {b}: tok/s (accept) vs plain" for b in spec_b) + " |")
    print("|---|" + "---|" * len(spec_b))
    for name, by_b in results.items():
        base = results[rows[name].baseline]
        cells = [f"{by_b[b][0]:,.0f} ({by_b[b][1]:.2f}) {by_b[b][0] / base[b][0]:.2f}x" for b in spec_b]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, core in cores.items():
        if hasattr(core.policy, "describe"):  # --spec-auto: what it measured and chose
            print(f"\n{name}: {core.policy.describe()}")
    del cores

    # ---- a rollout-shaped batch: most responses short, a few several times longer
    n = min(a.tail_requests, max(spec_b))
    if "plain" not in rows:  # --rows of the exact pair alone
        return
    if task is not None:
        batch, lengths = task.mixed(n, seed=777), [cap] * n
    else:
        torch.manual_seed(7)  # the same lengths in every run
        lengths = [max(8, min(10 * a.new_tokens, int(x))) for x in torch.distributions.LogNormal(
            torch.log(torch.tensor(a.new_tokens / 4.0)), 0.9).sample((n,)).tolist()]
        batch = prompts(n, a.prompt_len, a.vocab, seed=777)
    tail_ctx = max(len(x) for x in batch) + max(lengths) + 8
    print(f"\nlong-tailed rollout: {n} requests" + (
        " of 1- to 5-digit problems (half 1-digit), each to EOS" if task is not None else
        f", response lengths median {sorted(lengths)[n // 2]}, max {max(lengths)} tokens") + "\n")
    print("| method | total s | vs plain | share of time after 90% of requests finished | tokens |")
    print("|---|---|---|---|---|")
    tail = {}
    for name in [n for n in ("plain", "EAGLE k=3", "EAGLE k=3, adaptive", "EAGLE k=3, --spec-auto", "NGRAM 4 tokens",
                             f"STANDALONE trained {a.draft_layers}-layer k=3") if n in rows]:
        core = spec_engine(rows[name], tail_ctx)
        run(core, batch[:4], 8)
        tail[name] = run_long_tail(core, batch, lengths, ignore_eos=task is None)
        del core
        seconds, share, tokens = tail[name]
        print(f"| {name} | {seconds:.2f} | {tail['plain'][0] / seconds:.2f}x | {share:.0%} | {tokens} |", flush=True)


def train_drafts(a, target: Path, tmp: Path, core: EngineCore, shape: dict, train_prompts: list[list[int]],
                 held_out: list[list[int]], new_tokens: int) -> tuple[list[tuple[str, torch.Tensor]], Path]:
    """Train the target's MTP layer and a small STANDALONE draft (the target's first --draft-layers layers,
    embedding and lm_head, then distilled) on the target's own greedy continuations, in float32 off the serving
    engine. Returns the MTP weights to load into the serving engines and the draft's checkpoint."""
    teacher, _ = load_model(target, dtype="float32", device=a.device)
    corpus = greedy_corpus(core, teacher, train_prompts, new_tokens)
    held_out = greedy_corpus(core, teacher, held_out, new_tokens)
    del core
    print(f"\ntraining corpus: {describe(corpus)}")
    init_mtp_from_trunk(teacher)
    distill(list(teacher.model.mtp_layers.parameters()), partial(mtp_student, teacher), corpus, held_out,
            a.train_steps, a.train_lr, a.train_batch, "MTP layer")
    mtp_weights = [(n, t.detach().clone()) for n, t in teacher.state_dict().items() if "mtp_layers" in n]
    init = make_tiny_model(tmp / "draft_init", arch="llama", mtp_layers=0, vocab_size=a.vocab, dtype="bfloat16",
                           max_position_embeddings=1024, init_from=str(target),
                           **{**shape, "num_layers": a.draft_layers})
    if not a.train_standalone:  # --rows without its row: the untrained truncation stands in, never served
        return mtp_weights, init
    draft, _ = load_model(init, dtype="float32", device=a.device)
    distill([p for n, p in draft.named_parameters() if n.startswith("model.layers.") or n == "model.norm.weight"],
            partial(standalone_student, draft, teacher), corpus, held_out, a.train_steps, a.train_lr,
            a.train_batch, f"STANDALONE {a.draft_layers}-layer draft")
    trained = save_checkpoint(draft.to(torch.bfloat16), init, tmp / "draft")
    del teacher, draft
    return mtp_weights, trained


def serving_engine(row: "Row", context_length: int, *, device: str, max_running_requests: int,
                   cuda_graph: CudaGraphSettings, mtp_weights: list[tuple[str, torch.Tensor]]) -> EngineCore:
    """A bf16 engine for one row of the table; an EAGLE/NEXTN row serves the MTP layer trained in the bench."""
    core = EngineCore(str(row.path), row.spec, dtype="bfloat16", device=device,
                      max_running_requests=max_running_requests, context_length=context_length, cuda_graph=cuda_graph,
                      **row.options)
    if row.spec is not None and row.spec.speculative_algorithm in ("EAGLE", "NEXTN"):
        core.load_weights(mtp_weights, selector="all")
    return core


@dataclass
class Row:
    """One row of the speculative table: the target checkpoint, its speculative settings (None: plain), engine
    options, the plain row it is compared with, and whether it decodes random prompts to a fixed length (the
    exact pair, whose target is random whatever --target says)."""
    path: Path
    spec: SpecConfig | None
    options: dict
    baseline: str
    random_prompts: bool = False


def speculative_rows(target: Path, trained_draft: Path, exact_target: Path, exact_draft: Path, draft_layers: int
                     ) -> dict[str, Row]:
    eagle = lambda k: SpecConfig("EAGLE", k, 1, k + 1)  # noqa: E731
    standalone = lambda draft: resolve_or_raise({  # noqa: E731
        "speculative_algorithm": "STANDALONE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4, "speculative_draft_model_path": str(draft)})
    exact_plain = "plain, exact-pair target"
    return {"plain": Row(target, None, {}, "plain"), "EAGLE k=1": Row(target, eagle(1), {}, "plain"),
            "EAGLE k=3": Row(target, eagle(3), {}, "plain"), "EAGLE k=5": Row(target, eagle(5), {}, "plain"),
            "EAGLE k=3, adaptive": Row(target, SpecConfig("EAGLE", 3, 1, 4, speculative_adaptive=True), {}, "plain"),
            "EAGLE k=3, --spec-auto": Row(target, eagle(3), {"spec_auto": True}, "plain"),
            "NGRAM 4 tokens": Row(target, resolve_or_raise({"speculative_algorithm": "NGRAM",
                                                            "speculative_num_draft_tokens": 4}), {}, "plain"),
            f"STANDALONE trained {draft_layers}-layer k=3": Row(target, standalone(trained_draft), {}, "plain"),
            exact_plain: Row(exact_target, None, {}, exact_plain, random_prompts=True),
            f"STANDALONE exact {draft_layers}-layer k=3": Row(exact_target, standalone(exact_draft), {}, exact_plain,
                                                              random_prompts=True)}


if __name__ == "__main__":
    main()
