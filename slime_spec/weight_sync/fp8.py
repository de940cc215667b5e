"""Block-quantized FP8 checkpoints (DeepSeek-V3's format): read dequantized, synced quantized as SGLang serves them.

A checkpoint whose config.json has `quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
"weight_block_size": [128, 128], ...}` stores each quantized linear weight `X.weight` as float8_e4m3fn with a float32
`X.weight_scale_inv` of one value per [128, 128] block (ceil-divided at the edges): value = fp8 x scale. SGLang's
`Fp8Config` then builds those layers with exactly these two parameters, so a sync must send both, quantized from the
trainer's values (slime quantizes on the way out the same way, 128 x 128 blocks, scale = the block's max |x| / 448).

Which weights are quantized: the linear projections of each decoder layer's attention and MLP (experts and shared
experts included), the MTP layer's decoder too, not the router, norms, embeddings, lm_head nor the MTP layer's
`eh_proj`: the layers SGLang's DeepSeek-V3 / GLM-4.5 / Qwen3 models build with the quantization config (checked
against SGLang's own classes in the conformance suite). `ignored_layers` / `modules_to_not_convert` prefixes stay
unquantized, as SGLang's `Fp8Config` reads them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
# DeepSeek-V3's quantization_config, as its config.json has it
DEEPSEEK_V3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "weight_block_size": [128, 128]}
_QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?[a-z_]*proj(_with_mqa)?\.weight$")


class Fp8ConfigError(ValueError):
    """A quantization_config this sync cannot reproduce; the message names the field."""


@dataclass(frozen=True)
class Fp8BlockScheme:
    """The one FP8 scheme the sync reproduces: e4m3 weights, dynamic activations, float block scales."""

    block: tuple[int, int]
    ignored: tuple[str, ...] = ()

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "Fp8BlockScheme | None":
        """The scheme of a checkpoint's config.json; None without a quantization_config; Fp8ConfigError for a
        quantization this sync does not reproduce."""
        q = hf_config.get("quantization_config")
        if not q:
            return None
        if not isinstance(q, dict):
            raise Fp8ConfigError(f"config.json quantization_config is {type(q).__name__}, not an object")
        method = q.get("quant_method")
        if method != "fp8":
            raise Fp8ConfigError(f"config.json quantization_config.quant_method is {method!r}: the weight sync "
                                 "reproduces block-wise 'fp8' (DeepSeek-V3's format) only")
        checks = [("activation_scheme", q.get("activation_scheme"), "dynamic"), ("fmt", q.get("fmt", "e4m3"), "e4m3"),
                  ("scale_fmt", q.get("scale_fmt"), None)]
        for field, value, wanted in checks:
            if value != wanted:
                raise Fp8ConfigError(f"config.json quantization_config.{field} is {value!r}: the weight sync "
                                     f"reproduces {wanted!r} only")
        block = q.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                             for b in block)):
            raise Fp8ConfigError(f"config.json quantization_config.weight_block_size is {block!r}: the weight sync "
                                 "reproduces block-wise scales ([128, 128] as DeepSeek-V3 ships), not per-tensor ones")
        ignored = q.get("ignored_layers") or q.get("modules_to_not_convert") or ()
        return cls((block[0], block[1]), tuple(str(x).removeprefix("model.") for x in ignored))

    def quantizes(self, hf_name: str) -> bool:
        """Whether SGLang serves `hf_name` as an FP8 weight with a scale."""
        if not _QUANTIZED.match(hf_name):
            return False
        module = hf_name.removesuffix(".weight").removeprefix("model.")
        return not any(module == x or module.startswith(x + ".") for x in self.ignored)

    def scale_shape(self, shape: torch.Size) -> tuple[int, ...]:
        *batch, n, k = shape
        return (*batch, math.ceil(n / self.block[0]), math.ceil(k / self.block[1]))


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale per block) with weight ~= fp8 x scale; 2-D, edges ceil-divided."""
    n, k = weight.shape
    bn, bk = block
    pn, pk = math.ceil(n / bn) * bn, math.ceil(k / bk) * bk
    padded = torch.zeros(pn, pk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight
    blocks = padded.view(pn // bn, bn, pk // bk, bk)
    # an all-zero block keeps scale 1 (any scale gives the same zeros; 0 would make 0 / 0)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(pn, pk)[:n, :k].contiguous(), scale.view(pn // bn, pk // bk).contiguous()


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The values of an FP8 weight and its block scales, by SGLang's own `block_quant_dequant`."""
    from slime_spec.engine import sglang_stand_ins
    sglang_stand_ins.install()  # SGLang's quantization modules import its CUDA kernels' packages
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    return block_quant_dequant(weight, scale, list(block), dtype)


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def quantize_named(named: Iterable[tuple[str, torch.Tensor]], scheme: Fp8BlockScheme
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors as the FP8 checkpoint holds them: each quantized weight followed by its scale."""
    for name, tensor in named:
        if scheme.quantizes(name):
            q, s = quantize(tensor, scheme.block)
            yield name, q
            yield name + SCALE_SUFFIX, s
        else:
            yield name, tensor


def dequantize_pairs(named: list[tuple[str, torch.Tensor]], scheme: Fp8BlockScheme,
                     where: str = "in the same request") -> list[tuple[str, torch.Tensor]]:
    """One update request's tensors with each FP8 weight and its scale replaced by the weight's float32 values
    (what an engine holding dequantized weights loads). Fp8ConfigError for a weight without its scale in the
    request, a scale without its weight, or a scale of the wrong shape."""
    by_name = dict(named)
    out = []
    for name, tensor in named:
        if is_scale(name):
            weight = by_name.get(name.removesuffix(SCALE_SUFFIX))
            if weight is None or weight.dtype != FP8_DTYPE:
                raise Fp8ConfigError(f"{name}: a block scale without its float8_e4m3fn weight {where} (each "
                                     "quantized weight and its scale go together)")
            continue
        if tensor.dtype != FP8_DTYPE:
            out.append((name, tensor))
            continue
        scale = by_name.get(name + SCALE_SUFFIX)
        if scale is None:
            raise Fp8ConfigError(f"{name} is float8_e4m3fn with no {name + SCALE_SUFFIX} {where} (each quantized "
                                 "weight and its scale go together)")
        if tuple(scale.shape) != scheme.scale_shape(tensor.shape):
            raise Fp8ConfigError(f"{name + SCALE_SUFFIX} has shape {tuple(scale.shape)}; blocks of "
                                 f"{list(scheme.block)} over {tuple(tensor.shape)} need "
                                 f"{scheme.scale_shape(tensor.shape)}")
        out.append((name, dequantize(tensor, scale.float(), scheme.block, torch.float32)))
    return out


def dequantize_state(state: dict[str, torch.Tensor], scheme: Fp8BlockScheme,
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint's tensors with every weight and scale pair replaced by the weight's values, every
    floating-point tensor in `dtype`."""
    return {n: t.to(dtype) if t.is_floating_point() else t
            for n, t in dequantize_pairs(list(state.items()), scheme, where="in the checkpoint")}
