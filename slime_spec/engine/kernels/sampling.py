"""Temperature sampling over the vocabulary in one pass per row: what SGLang's sampler gets from flashinfer's fused
sampling kernels (`--sampling-backend flashinfer`, its default on CUDA).

Eagerly, sampling a row of logits at temperature T with its logprob is a dozen passes over [rows, vocab] floats
(divide, softmax, the exponential race's noise, divide, argmax, and logsumexp's max, subtract, exp and sum again for
the logprob), and a chain verify does it for k + 1 positions per row: at a 152k vocabulary and 128 rows, more device
time than the verify's forward. Here one program reads one row once and returns everything the sampler and the
speculative acceptance need of it:

- logsumexp of z = x / T (online, as flash attention's softmax),
- a token drawn from softmax(z) by the Gumbel-max trick (argmax of z + Gumbel noise, Philox noise keyed by a seed
  drawn from the engine's generator, so a seeded engine repeats itself), optionally never a given `exclude` token:
  then it is drawn from softmax(z) with that token removed and renormalised, the residual of speculative sampling
  after a deterministic draft is rejected,
- z at the drawn token and at a given `probe` token (the draft's),
- whether the row's logits are all finite.

Rows with top-k, top-p or min-p filters keep the eager path (model_executor/sampling.py).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

BLOCK = 1024  # vocabulary entries per iteration of a row's program (a multiple of 4)


class SampledRows(NamedTuple):
    """Per row [N]: the drawn token (int64), z = x / T at it and at the probe token (0 where there is none),
    logsumexp(z), and whether every logit of the row is finite (bool)."""

    tokens: torch.Tensor
    token_z: torch.Tensor
    probe_z: torch.Tensor
    lse: torch.Tensor
    finite: torch.Tensor


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sample_kernel(x_ptr, stride_x, temps_ptr, exclude_ptr, probe_ptr, seed_ptr, token_ptr, token_z_ptr,
                      probe_z_ptr, lse_ptr, finite_ptr, V, BLOCK: tl.constexpr):
        # Every lane keeps its own running state over the row (max and sum of exp for logsumexp, best noisy score
        # and its token, non-finite count), reduced across lanes once at the end: a reduction per block would
        # synchronise the program's warps 4 times per block.
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * stride_x
        t = tl.load(temps_ptr + row)
        exclude = tl.load(exclude_ptr + row).to(tl.int32)
        seed = tl.load(seed_ptr) + row  # one Philox key per row; the offset is the token
        lanes = tl.arange(0, BLOCK)
        fallback = tl.maximum(exclude, 0)  # kept only if every other score is -inf: p itself, as the eager residual
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        best = tl.full((BLOCK,), float("-inf"), tl.float32)
        best_i = tl.zeros((BLOCK,), tl.int32) + fallback
        bad = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + lanes
            ok = offs < V
            x = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
            bad += (((x != x) | (tl.abs(x) == float("inf"))) & ok).to(tl.int32)
            z = tl.where(ok, x / t, float("-inf"))
            m_new = tl.maximum(m, z)
            s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.exp(z - m_new))
            m = m_new
            # one Philox call gives four uniforms (tl.rand uses one of them): tokens 4q..4q+3 share call q
            r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + tl.arange(0, BLOCK // 4))
            u = tl.uint_to_uniform_float(tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (BLOCK,)))
            score = tl.where(ok & (offs != exclude), z - tl.log(-tl.log(u)), float("-inf"))
            take = score > best
            best_i = tl.where(take, offs, best_i)
            best = tl.where(take, score, best)
        row_max = tl.max(m, 0)
        total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max)), 0)
        top = tl.max(best, 0)
        # the smallest token at the top score, as a left-first argmax (scores tie only where all are -inf)
        pick = tl.min(tl.where(best == top, best_i, V), 0)
        pick = tl.where(pick < V, pick, fallback)  # a NaN row matches no lane: any token in range
        probe = tl.load(probe_ptr + row)
        tl.store(token_ptr + row, pick.to(tl.int64))
        tl.store(token_z_ptr + row, tl.load(base + pick).to(tl.float32) / t)
        tl.store(probe_z_ptr + row, tl.where(probe >= 0, tl.load(base + tl.maximum(probe, 0)).to(tl.float32) / t,
                                             0.0))
        tl.store(lse_ptr + row, row_max + tl.log(total))
        tl.store(finite_ptr + row, (tl.sum(bad, 0) == 0).to(tl.int8))

    return sample_kernel


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator | None = None,
                exclude: torch.Tensor | None = None, probe: torch.Tensor | None = None) -> SampledRows:
    """logits [N, V] (any float dtype, unit stride along V), temperatures [N] > 0; exclude / probe [N] token ids
    (-1: none). One token per row from softmax(logits / T), never the row's `exclude` token (unless nothing else
    has mass), with the statistics of SampledRows. The noise's seed is drawn from `generator` on the device: no
    host synchronisation, and the same generator state gives the same tokens."""
    import triton

    n, vocab = logits.shape
    if logits.stride(-1) != 1 or temperatures.shape != (n,):
        raise ValueError(f"sample_rows: logits {tuple(logits.shape)} with strides {logits.stride()}, temperatures "
                         f"{tuple(temperatures.shape)}: needs unit-stride rows and one temperature per row")
    dev = logits.device
    none = torch.full((n,), -1, dtype=torch.int64, device=dev) if exclude is None or probe is None else None
    exclude = none if exclude is None else exclude
    probe = none if probe is None else probe
    seed = torch.randint(0, 2 ** 62, (1,), generator=generator, device=dev)
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    token_z, probe_z, lse = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(3))
    finite = torch.empty(n, dtype=torch.int8, device=dev)
    block = max(4, min(BLOCK, triton.next_power_of_2(vocab)))  # a small vocabulary: no noise drawn for masked lanes
    _kernel()[(n,)](logits, logits.stride(0), temperatures.float().contiguous(), exclude.contiguous(),
                    probe.contiguous(), seed, tokens, token_z, probe_z, lse, finite, vocab, BLOCK=block,
                    num_warps=8 if block >= 1024 else 4)
    return SampledRows(tokens, token_z, probe_z, lse, finite.view(torch.bool))
