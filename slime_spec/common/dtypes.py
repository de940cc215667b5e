"""dtype names: the one table of accepted spellings, and the one config.json dtype lookup.

Torch-free at import (torch is imported only to return a `torch.dtype`), so the checks that read
config.json without a model (doctor, spec_check, the engine's server args) can use it.
"""

from __future__ import annotations

# Every spelling SGLang's --dtype and HF config.json use -> the torch attribute name.
DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
               "half": "float16"}
DTYPES = tuple(sorted(set(DTYPE_NAMES.values())))  # the canonical names: bfloat16, float16, float32


def canonical_dtype(name: str) -> str:
    """'torch.bfloat16' or 'bfloat16' -> 'bfloat16', 'half' -> 'float16'; ValueError names the choices."""
    key = str(name).removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r}: choose one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[key]


def config_dtype(hf_config: dict) -> str | None:
    """The checkpoint dtype in config.json (`torch_dtype`, or `dtype` in newer transformers); None when unset.

    Known spellings come back canonical; any other name comes back as written, for the caller to judge.
    """
    value = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if not value:
        return None
    key = str(value).removeprefix("torch.")
    return DTYPE_NAMES.get(key, key)


def torch_dtype(name: str):
    """The `torch.dtype` for a name `canonical_dtype` accepts."""
    import torch

    return getattr(torch, canonical_dtype(name))
