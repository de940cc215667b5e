"""Read pushed weights back from an engine and compare their VALUES with the tensors that were sent.

Used by `--check-weight-sync` (sync.py) and `slime-spec push-weights --check`. Two ways, per engine:

- `/get_weights_by_name` (preferred): the first rows of a target tensor as float32. Compared with the
  same block of the sent tensor cast to the engine's dtype, at that dtype's tolerance (its machine
  epsilon, relative and absolute). SGLang 0.5.23 serves this route only for Llama-family models (MiMo,
  Qwen2, DeepSeek answer 400), for the target runner only, and at TP > 1 answers TP rank 0's shard,
  which is compared as the leading block of the full tensor. Only a sample of tensors is read (one
  HTTP request each, as nested JSON lists).
- `/weights_checker {"action": "checksum"}`, only when the engine reports `device: cpu`: SGLang's
  WeightChecker hashes every parameter of every runner as its model classes hold it (fused q/k/v and
  gate/up, vocabulary padded, MTP block renamed, the engine's dtype); weight_sync/verify/sglang_params.py builds those
  same
  tensors from the sent ones and hashes them with SGLang's own `tensor_hash`, and every served tensor the
  sync wrote is compared by name. On CPU that hash is a sha256 of the raw bytes; on GPU SGLang hashes with
  a Triton kernel whose values differ, so a GPU engine whose model lacks `/get_weights_by_name` cannot be
  value-checked: the check says so and fails rather than pass unverified.
"""

from __future__ import annotations

import heapq
import zlib
from dataclasses import dataclass, field

import torch

from slime_spec.fleet.client import EngineClient, EngineError
from slime_spec.weight_sync import protocol

BY_NAME = "get_weights_by_name"
CHECKSUM = "weights_checker"
SAMPLE_ROWS = 4


def tolerance(dtype: torch.dtype) -> float:
    """Relative and absolute tolerance for values served in `dtype`: one unit of its precision."""
    return float(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


class ValueSample:
    """The first `rows` rows of a bounded, deterministic sample of sent target tensors, in the engine dtype.

    Streaming: the sample is the `size` names with the smallest crc32, so it spreads over all layers,
    is the same on every run, and never holds more than `size` slices.
    """

    def __init__(self, engine_dtype: torch.dtype | None, size: int = 64, rows: int = SAMPLE_ROWS):
        self.engine_dtype, self.size, self.rows = engine_dtype, size, rows
        self._heap: list[tuple[int, str]] = []  # (-crc, name): the largest crc is evicted first
        self.slices: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        key = -zlib.crc32(name.encode())
        if len(self._heap) >= self.size:
            if key <= self._heap[0][0]:
                return
            _, evicted = heapq.heapreplace(self._heap, (key, name))
            del self.slices[evicted]
        else:
            heapq.heappush(self._heap, (key, name))
        t = tensor.detach()[: self.rows] if tensor.dim() else tensor.detach()
        t = t.cpu()
        self.slices[name] = (t.to(self.engine_dtype) if self.engine_dtype is not None else t).float().clone()

    def names(self) -> list[str]:
        return sorted(self.slices)


@dataclass
class ValueCheck:
    """One engine's value check: which method, how many tensors compared, what differed."""

    url: str
    methods: list[str] = field(default_factory=list)
    compared: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.methods) and not self.problems


def compare_block(name: str, sent: torch.Tensor, served: list, dtype: torch.dtype | None) -> str | None:
    """None when `served` (the engine's leading rows, float32 lists) equals that block of `sent`."""
    got = torch.tensor(served, dtype=torch.float32)
    if got.dim() != sent.dim() or any(g > s for g, s in zip(got.shape, sent.shape)) or got.numel() == 0:
        return f"{name}: engine serves shape {list(got.shape)} (first rows), sent {list(sent.shape)}"
    want = sent[tuple(slice(0, g) for g in got.shape)]
    tol = tolerance(dtype or torch.float32)
    if not torch.allclose(got, want, rtol=tol, atol=tol):
        diff = (got - want).abs().max().item()
        return f"{name}: max |engine - sent| = {diff:.3g} over the first {got.shape[0]} row(s) (tolerance {tol:.3g})"
    return None


def by_name_supported(client: EngineClient, probe: str) -> bool:
    """Whether the served model answers /get_weights_by_name (SGLang: Llama family only; others 400)."""
    try:
        client.post("/get_weights_by_name", protocol.get_weights_payload(probe, 1))
        return True
    except EngineError as e:
        if e.status in (400, 404, 500):
            return False
        raise


def check_by_name(client: EngineClient, sample: ValueSample, check: ValueCheck) -> None:
    for name in sample.names():
        try:
            reply = client.post("/get_weights_by_name", protocol.get_weights_payload(name, sample.rows))
        except EngineError as e:
            check.problems.append(f"{name}: not served ({e.status}: {e.body[:200]})")
            continue
        values = reply.get("result") if isinstance(reply, dict) else reply
        problem = compare_block(name, sample.slices[name], values or [], sample.engine_dtype)
        check.compared += 1
        if problem:
            check.problems.append(problem)


def check_values(client: EngineClient, sample: ValueSample, *, device: str | None, probe: str,
                 checksum_problems: list[str] | None, checksum_count: int) -> ValueCheck:
    """Compare values on one engine by every method it allows; `checksum_problems` is None when the
    engine has no /weights_checker (checksums only count when the engine runs on CPU); `probe`: a sent
    target name the engine surely serves, asked once to learn whether the model answers by name."""
    check = ValueCheck(client.url)
    names = sample.names()
    if names and by_name_supported(client, probe):
        check.methods.append(BY_NAME)
        check_by_name(client, sample, check)
    if device == "cpu" and checksum_problems is not None:
        check.methods.append(CHECKSUM)
        check.compared += checksum_count
        check.problems += checksum_problems
    if not check.methods:
        check.problems.append(
            f"values cannot be compared: the served model does not answer /get_weights_by_name (SGLang serves it "
            f"for Llama-family models only) and the engine runs on device {device!r}, where SGLang's "
            "/weights_checker hashes with a Triton kernel this check does not reproduce; coverage (every served "
            "weight was written) is still checked without the value check")
    return check
