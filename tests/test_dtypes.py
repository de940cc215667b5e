import pytest
import torch

from slime_spec.common.dtypes import DTYPES, canonical_dtype, config_dtype, torch_dtype


def test_every_spelling_maps_to_one_canonical_name():
    assert DTYPES == ("bfloat16", "float16", "float32")
    assert [canonical_dtype(n) for n in ("half", "float16", "torch.float16", "float", "bfloat16")] == \
        ["float16", "float16", "float16", "float32", "bfloat16"]
    with pytest.raises(ValueError, match=r"dtype 'int8': choose one of \['bfloat16', 'float', 'float16'"):
        canonical_dtype("int8")


def test_config_dtype_reads_either_key():
    assert config_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert config_dtype({"dtype": "torch.float16"}) == "float16"  # newer transformers write `dtype`
    assert config_dtype({"torch_dtype": "float8_e4m3fn"}) == "float8_e4m3fn"  # unknown: as written
    assert config_dtype({}) is None


def test_torch_dtype():
    assert torch_dtype("half") is torch.float16 and torch_dtype("bfloat16") is torch.bfloat16
