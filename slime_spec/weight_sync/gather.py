"""From the trainer's parameters to buckets of HF-named full tensors.

Three steps, each a plain function:
1. gather: every tensor-parallel rank holds a shard; all-gather them over Megatron's TP group and
   merge them (`convert.merge_tp_shards`: along `tp_split_dim`, regrouping the per-rank [gate; up]
   halves of `linear_fc1`), a routed expert over the expert-TP group instead (the TP group unless
   --expert-tensor-parallel-size says otherwise); a routed expert is then all-gathered over the
   expert-parallel group, each rank's experts renamed to their global numbers.
2. convert: Megatron name and layout -> HF names (`convert.megatron_to_hf`), MTP layers marked.
3. bucket: group the HF tensors into buckets of at most `buffer_bytes` (one tensor larger than the
   buffer gets a bucket of its own), target and MTP tensors never mixed, so each kind can go to the
   runners that serve it, and the halves of a pair the engine fuses on load kept together, as is an FP8
   weight with its scale.

Every TP (and EP) rank must iterate the same parameters in the same order (the all-gathers are collective);
only the sending rank uses the result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Literal

import torch
import torch.distributed as dist

Kind = Literal["target", "mtp", "draft"]  # draft: a separate draft model's own tensors (EAGLE3)


@dataclass(frozen=True)
class NamedTensor:
    name: str
    tensor: torch.Tensor
    kind: Kind = "target"

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass
class Bucket:
    kind: Kind
    tensors: list[NamedTensor] = field(default_factory=list)
    last: bool = False  # the stream's final bucket: its update request may close the sync (label, flush)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]


# Halves an engine fuses only when both arrive in one update request: SGLang's DeepSeek-V2/V3 loader
# (deepseek_weight_loader.py) caches `q_a_proj` and `kv_a_proj_with_mqa` of a layer and writes the fused
# `fused_qkv_a_proj_with_mqa` once it holds both; a half whose partner is in another request is never loaded.
FUSED_PAIRS = (("q_a_proj", "kv_a_proj_with_mqa"),)


def fused_partner(name: str) -> str | None:
    """The other half of a fused pair (`...q_a_proj.weight` <-> `...kv_a_proj_with_mqa.weight`), or None."""
    for a, b in FUSED_PAIRS:
        if f".{a}." in name:
            return name.replace(f".{a}.", f".{b}.")
        if f".{b}." in name:
            return name.replace(f".{b}.", f".{a}.")
    return None


def _layer_of(name: str) -> str:
    m = re.match(r"^(model\.(?:layers|mtp_layers)\.\d+)\.", name)
    return m.group(1) if m else ""


def _with_scales(tensors: Iterable[NamedTensor]) -> Iterator[list[NamedTensor]]:
    """Each tensor with the FP8 block scale that follows it (`X.weight`, then `X.weight_scale_inv`, as `quantized`
    sends them), which an engine holding dequantized weights needs in the same request. Only an FP8 tensor waits for
    the next one: any other is handed on at once, so a stream that fails has sent what came before."""
    from slime_spec.weight_sync.fp8 import FP8_DTYPE, SCALE_SUFFIX
    held: NamedTensor | None = None
    for t in tensors:
        if held is not None:
            if t.name == held.name + SCALE_SUFFIX:
                yield [held, t]
                held = None
                continue
            yield [held]
            held = None
        if t.tensor.dtype == FP8_DTYPE:
            held = t
        else:
            yield [t]
    if held is not None:
        yield [held]


def _units(tensors: Iterable[NamedTensor]) -> Iterator[list[NamedTensor]]:
    """Tensors in order, a weight with its FP8 scale, and a fused pair's halves joined into one unit (the first
    half waits for the second).

    A half waits only while its layer lasts: the pairs are per layer, so a half whose partner does not
    come (a model without `q_lora_rank` has no `q_a_proj`) goes on alone when the next layer starts.
    """
    waiting: dict[str, list[NamedTensor]] = {}  # partner name -> the half (with its scale) that waits for it
    for item in _with_scales(tensors):
        name = item[0].name
        for partner in [n for n, w in waiting.items() if _layer_of(w[0].name) != _layer_of(name)]:
            yield waiting.pop(partner)
        if name in waiting:
            yield [*waiting.pop(name), *item]
            continue
        partner = fused_partner(name)
        if partner is None:
            yield item
        else:
            waiting[partner] = item
    yield from waiting.values()


def make_buckets(tensors: Iterable[NamedTensor], buffer_bytes: int) -> Iterator[Bucket]:
    """Group tensors, in order, into buckets of at most `buffer_bytes`; each kind (target, MTP, draft) apart.

    The two halves of a fused pair (`FUSED_PAIRS`) always share a bucket, even if that makes it larger
    than the buffer. Streams: a bucket is yielded as soon as it is full, so only one bucket per kind is
    held at a time. The final bucket is marked `last` (a full bucket is yielded only when a tensor follows it, so
    the stream knows its end without reading ahead).
    """
    if buffer_bytes <= 0:
        raise ValueError(f"update_weight_buffer_size={buffer_bytes}: must be a positive number of bytes")
    open_buckets: dict[str, Bucket] = {}
    for unit in _units(tensors):
        kind, unit_bytes = unit[0].kind, sum(t.nbytes for t in unit)
        bucket = open_buckets.get(kind)
        if bucket is not None and bucket.tensors and bucket.nbytes + unit_bytes > buffer_bytes:
            yield bucket
            bucket = None
        if bucket is None:
            bucket = open_buckets[kind] = Bucket(kind)
        bucket.tensors.extend(unit)
    remaining = [b for b in open_buckets.values() if b.tensors]
    for i, bucket in enumerate(remaining):
        bucket.last = i == len(remaining) - 1
        yield bucket


def quantized(tensors: Iterable[NamedTensor], scheme) -> Iterator[NamedTensor]:
    """The sync's stream for engines serving an FP8 checkpoint (`scheme`: fp8.Fp8BlockScheme): each target or MTP
    weight the checkpoint quantizes, quantized on the device it is on and followed at once by its scale (which
    `make_buckets` keeps in its bucket); a separate draft's tensors as they are (its own checkpoint is not this one)."""
    from slime_spec.weight_sync.fp8 import quantize_named
    for t in tensors:
        if t.kind == "draft":
            yield t
            continue
        for name, tensor in quantize_named([(t.name, t.tensor)], scheme):
            yield NamedTensor(name, tensor, t.kind)


def gather_tp_param(megatron_name: str, shard: torch.Tensor, tp_group=None, tp_size: int = 1) -> torch.Tensor:
    """All-gather one parameter's shards over the TP group (collective: every TP rank must call it)."""
    from slime_spec.weight_sync import convert
    shard = shard.detach()
    if tp_size == 1 or convert.tp_split_dim(megatron_name) is None:
        return shard
    shard = shard.contiguous()
    shards = [torch.empty_like(shard) for _ in range(tp_size)]
    dist.all_gather(shards, shard, group=tp_group)
    return convert.merge_tp_shards(megatron_name, shards)


def gather_ep_param(megatron_name: str, tensor: torch.Tensor, hf_config: dict, ep_group=None,
                    ep_size: int = 1) -> list[tuple[str, torch.Tensor]]:
    """A routed expert's (TP-whole) tensor from every expert-parallel rank, renamed to the global expert
    numbers: EP rank r's `local_experts.{i}` is expert r * E / ep_size + i. Collective over the EP group for
    expert names (every EP rank holds the same number of experts of the same shapes); other names pass through."""
    from slime_spec.weight_sync import convert
    if ep_size == 1 or convert.expert_index(megatron_name) is None:
        return [(megatron_name, tensor)]
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(ep_size)]
    dist.all_gather(parts, tensor, group=ep_group)
    return [(convert.global_expert_name(megatron_name, r, ep_size, hf_config), part) for r, part in enumerate(parts)]


def iter_hf_tensors(named_params: Iterable[tuple[str, torch.Tensor]], hf_config: dict, *,
                    tp_group=None, tp_size: int = 1, ep_group=None, ep_size: int = 1, etp_group=None,
                    etp_size: int | None = None) -> Iterator[NamedTensor]:
    """Megatron (name, local shard) pairs -> HF-named full tensors, MTP layers marked `kind="mtp"`; under expert
    parallelism every EP rank's experts (each rank must then iterate its own experts in the same order). A routed
    expert is split over the expert-TP ranks (`etp_group`; None: the TP ranks, Megatron's default)."""
    from slime_spec.weight_sync import convert
    family = convert.family_of(hf_config)
    for megatron_name, shard in named_params:
        group, size = convert.tp_split_of(megatron_name, (tp_group, tp_size),
                                          None if etp_size is None else (etp_group, etp_size))
        full = gather_tp_param(megatron_name, shard, group, size)
        kind: Kind = "mtp" if convert.is_mtp_param(megatron_name) else "target"
        for name, whole in gather_ep_param(megatron_name, full, hf_config, ep_group, ep_size):
            for hf_name, tensor in convert.megatron_to_hf(family, name, whole, hf_config):
                yield NamedTensor(hf_name, tensor.contiguous(), kind)


def hf_mtp_matcher(hf_config: dict) -> Callable[[str], bool]:
    """Which HF names are MTP layers: MiMo's `model.mtp_layers.*`, DeepSeek-V3/GLM's `model.layers.{>=N}`."""
    n = int(hf_config["num_hidden_layers"])
    layer = re.compile(r"^model\.layers\.(\d+)\.")

    def is_mtp(name: str) -> bool:
        if name.startswith("model.mtp_layers."):
            return True
        m = layer.match(name)
        return m is not None and int(m.group(1)) >= n

    return is_mtp


def iter_hf_state(state: dict[str, torch.Tensor], hf_config: dict) -> Iterator[NamedTensor]:
    """An HF state dict (already full, HF-named) as sync tensors: for HF-side trainers, tests and the benchmark."""
    is_mtp = hf_mtp_matcher(hf_config)
    for name, tensor in state.items():
        yield NamedTensor(name, tensor.detach().contiguous(), "mtp" if is_mtp(name) else "target")


def iter_draft_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[NamedTensor]:
    """A separate draft's own tensors (EAGLE3: checkpoint names, never the embedding it shares with the
    target), marked `kind="draft"`: they go to the draft runner alone, with selector `draft`."""
    for name, tensor in named_tensors:
        yield NamedTensor(name, tensor.detach().contiguous(), "draft")


def only_wanted_kinds(tensors: Iterable[NamedTensor], *, mtp: bool, draft: bool) -> Iterator[NamedTensor]:
    """Drop MTP tensors when no runner should receive them (no draft, or an external draft); a draft tensor
    without a trained draft is an error (the frozen draft must never be overwritten)."""
    for t in tensors:
        if t.kind == "draft" and not draft:
            raise ValueError(f"draft tensor {t.name} sent, but this syncer keeps the draft frozen: "
                             "--enable-draft-training builds the syncer with trains_draft=True")
        if t.kind != "mtp" or mtp:
            yield t


def only_wanted(tensors: Iterable[NamedTensor], plan) -> Iterator[NamedTensor]:
    """`only_wanted_kinds` for a protocol.SelectorPlan (a kind whose selector is None is not sent)."""
    return only_wanted_kinds(tensors, mtp=plan.mtp is not None, draft=plan.draft is not None)
