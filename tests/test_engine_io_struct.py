"""`/generate` bodies split and normalized as SGLang's GenerateReqInput does (pure functions, no server)."""

from transformers import AutoTokenizer

from slime_spec.engine.io_struct import plan_generate, spec_meta_info
from slime_spec.tiny_model import make_tiny_model


def test_plan_generate_normalizes_like_sglang(tmp_path):
    tok = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "m", arch="llama", hidden_size=32, num_layers=1))
    planned, single = plan_generate({"text": ["ab", "cd"], "rid": "r", "sampling_params": {"temperature": 0.7, "n": 2,
                                     "top_k": -1, "stop": "x"}}, tok, vocab_size=101, context_len=1024)
    assert not single and [p.rid for p in planned] == ["r_0", "r_1", "r_0_1", "r_1_1"]
    p = planned[0].params
    assert (p.temperature, p.top_k, p.stop, p.max_new_tokens) == (0.7, -1, ["x"], 128)
    planned, single = plan_generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": None,
                                     "temperature": 0}}, tok, vocab_size=101, context_len=64)
    assert single and planned[0].params.max_new_tokens == 62  # SGLang: until the context is full
    assert planned[0].params.temperature == 0.0  # SGLang's greedy (temperature 0 -> top_k 1)
    assert spec_meta_info(False, 10, 4, 6, 12) == {}
    assert spec_meta_info(True, 10, 0, 0, 0) == {}
    meta = spec_meta_info(True, 10, 4, 6, 12)
    assert meta["spec_accept_length"] == 2.5 and meta["spec_accept_rate"] == 0.5 and meta["spec_verify_ct"] == 4
