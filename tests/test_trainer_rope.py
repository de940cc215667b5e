"""The trainer's RoPE (plain and Llama-3.1 "llama3" scaling) equals transformers' own computation."""

from __future__ import annotations

import pytest
import torch

from slime_spec.common import rope
from slime_spec.config.run_config import TrainConfig
from slime_spec.tools.tiny_model import LLAMA31_ROPE_SCALING, make_tiny_model
from slime_spec.trainer import model as M
from slime_spec.trainer import parallel


@pytest.fixture(scope="module", autouse=True)
def megatron():
    parallel.init_single_process(seed=0)


def hf_inv_freq(fields: dict) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(**fields)
    rope_type = (fields.get("rope_scaling") or {}).get("rope_type", "default")
    if rope_type == "default":
        dim = fields["head_dim"]
        return 1.0 / (fields["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    assert attention_factor == 1.0
    return inv


@pytest.mark.parametrize("scaling", [
    None,
    LLAMA31_ROPE_SCALING,
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 512},
])
def test_inv_freq_equals_transformers(scaling):
    fields = {"hidden_size": 256, "num_attention_heads": 2, "head_dim": 128, "rope_theta": 500000.0,
              "max_position_embeddings": 131072}
    if scaling is not None:
        fields["rope_scaling"] = dict(scaling)
    ours = rope.inv_freq(rope.rope_spec(fields), 128)
    ref = hf_inv_freq(fields)
    torch.testing.assert_close(ours, ref.float(), atol=0, rtol=1e-6)
    if scaling is not None:  # the scaling really moved some frequencies (the test is not of plain RoPE)
        assert not torch.allclose(ours, rope.default_inv_freq(128, 500000.0))


def test_bad_rope_configs_are_clear_errors():
    with pytest.raises(ValueError, match="'yarn'"):
        rope.rope_spec({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope.rope_spec({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0}})
    assert rope.rope_spec({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}).theta == 7.0


def test_llama31_logits_equal_transformers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = make_tiny_model(tmp_path, arch="llama", seed=2, rope_scaling=LLAMA31_ROPE_SCALING, rope_theta=500000.0,
                           max_position_embeddings=512)
    hf_config, hf_state = M.read_hf_config(path), M.read_hf_state(path)
    model = M.build_gpt_model(hf_config, TrainConfig(hf_checkpoint=str(path)))
    M.load_hf_weights(model, hf_state, hf_config, tp_rank=0, tp_size=1)
    ref = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in hf_config.items() if k != "architectures"}))
    ref.load_state_dict(hf_state)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = M.forward(model.eval(), ids, hf_config["vocab_size"]).logits
        expected = ref.eval()(ids).logits
        plain = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in hf_config.items()
                                                if k not in ("architectures", "rope_scaling")}))
        plain.load_state_dict(hf_state)
        unscaled = plain.eval()(ids).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    assert (unscaled - expected).abs().max() > 1e-2  # positions up to 200 see the scaling
