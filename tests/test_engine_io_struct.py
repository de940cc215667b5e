"""`/generate` bodies split and normalized as SGLang's GenerateReqInput does (pure functions, no server)."""

import re

import pytest
from transformers import AutoTokenizer

from slime_spec.engine.io_struct import (MAX_PARALLEL_SAMPLE_NUM, check_field_types, explain_contract_error,
                                         longest_token_chars, min_prompt_tokens, plan_generate, spec_meta_info)
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


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("io") / "m", arch="llama", hidden_size=32, num_layers=1)
    return AutoTokenizer.from_pretrained(path)


def plan(tok, body, **kw):
    return plan_generate(body, tok, vocab_size=101, context_len=64, **kw)


@pytest.mark.parametrize("body, limits, needle", [
    ({"text": "a", "sampling_params": {"n": 0}}, {}, "sampling_params.n=0"),
    ({"text": "a", "sampling_params": {"n": MAX_PARALLEL_SAMPLE_NUM + 1}}, {}, "limit of 1024 parallel samples"),
    ({"text": "a", "sampling_params": {"n": 20000}}, {}, "sampling_params.n=20000"),
    ({"text": ["a", "b"], "sampling_params": {"n": 3}}, {"max_sequences": 5}, "2 prompt(s) x sampling_params.n=3"),
    ({"text": ["a"] * 6}, {"max_sequences": 5}, "text: a batch of 6 prompts"),
    ({"text": "x" * 100_000}, {"max_token_chars": 8}, "text has 100000 characters"),
    ({"text": ["ok", "x" * 100_000]}, {"max_token_chars": 8}, "text[1] has 100000 characters"),
    ({"text": []}, {}, "text: the batch is empty"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, {}, "sampling_params: max_new_tokens"),
    ({"text": ["a", "b"], "rid": ["same", "same"]}, {}, "rid: 'same' appears twice"),
])
def test_limits_are_refused_naming_the_field(tok, body, limits, needle):
    with pytest.raises(ValueError) as e:
        plan(tok, body, **limits)
    assert needle in str(e.value)


def test_limits_are_checked_before_tokenizing(tok):
    class NoEncode:  # test double: a tokenizer that must not be asked to encode
        def __getattr__(self, name):
            if name == "encode":
                raise AssertionError("tokenized before the limits were checked")
            return getattr(tok, name)

    for body, limits in [({"text": "a", "sampling_params": {"n": 20000}}, {}),
                         ({"text": ["a"] * 6}, {"max_sequences": 5}),
                         ({"text": "x" * 100_000}, {"max_token_chars": 8})]:
        with pytest.raises(ValueError):
            plan_generate(body, NoEncode(), vocab_size=101, context_len=64, **limits)


def test_the_length_bound_never_refuses_a_prompt_that_fits(tok):
    longest = longest_token_chars(tok)
    text = "hello world " * 10
    assert len(tok.encode(text)) >= min_prompt_tokens(text, longest)
    planned, _ = plan(tok, {"text": "hello", "sampling_params": {"max_new_tokens": 4}}, max_token_chars=longest)
    assert len(planned) == 1
    planned, _ = plan(tok, {"text": "a", "sampling_params": {"n": MAX_PARALLEL_SAMPLE_NUM, "max_new_tokens": 1}})
    assert len(planned) == MAX_PARALLEL_SAMPLE_NUM


@pytest.mark.parametrize("body, field, fix", [
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature", "as a number"),
    ({"text": "a", "sampling_params": [{"top_k": 1.5}]}, "sampling_params[0].top_k", "as an integer"),
    ({"text": "a", "sampling_params": {"stop_token_ids": ["x"]}}, "sampling_params.stop_token_ids",
     "each element of"),
    ({"input_ids": [["a"]]}, "input_ids", "each element of input_ids as an integer"),
    ({"text": [1, 2]}, "text", "as a string"),
    ({"text": "a", "rid": 5}, "rid", "a string or a list of strings"),
    ({"text": "a", "return_logprob": "yes"}, "return_logprob", "true/false"),
])
def test_contract_errors_name_the_field_and_the_fix(body, field, fix):
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    message = generate_contract_error(body)
    assert message is not None and field not in message  # SGLang's own message does not say where
    explained = explain_contract_error(body, message, generate_contract_error)
    assert explained.startswith(f"{field}: ") and fix in explained


@pytest.mark.parametrize("struct, body, needle", [
    ("UpdateWeightVersionReqInput", {"new_version": {"a": 1}}, "new_version={'a': 1}"),
    ("UpdateWeightFromDiskReqInput", {"model_path": 5}, "model_path=5"),
    ("ReleaseMemoryOccupationReqInput", {"tags": "weights"}, "tags='weights'"),
    ("InitWeightsUpdateGroupReqInput", {"master_address": "h", "master_port": "x", "rank_offset": 1,
                                        "world_size": 2}, "master_port='x'"),
    ("BeginWeightUpdateReqInput", {"selector": "everything"}, "invalid selector 'everything'"),
    ("AbortReq", {"rid": 5}, "rid=5"),
    ("GetWeightsByNameReqInput", {"name": "w", "truncate_size": True}, "truncate_size=True"),
])
def test_control_bodies_are_checked_against_sglang_annotations(struct, body, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        check_field_types(struct, body)


def test_well_typed_control_bodies_pass():
    check_field_types("UpdateWeightsFromDistributedReqInput", {"names": ["a"], "dtypes": ["bfloat16"],
                                                               "shapes": [[2, 3]], "weight_version": None,
                                                               "selector": "draft"})
    check_field_types("ReleaseMemoryOccupationReqInput", {"tags": ["weights"]})
    check_field_types("UpdateWeightsFromTensorReqInput", {"serialized_named_tensors": ["b64"], "flush_cache": True})
