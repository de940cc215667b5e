"""rollout/generate.py: the default generate function's payload, a group's batched payload, and what one answer
adds to a sample."""

import asyncio

import pytest

from slime_spec.config.run_config import RolloutConfig
from slime_spec.fleet.sglang_contract import validate_payload
from slime_spec.rollout.generate import apply_generate_output, default_generate, default_generate_group, group_request
from slime_spec.rollout.sample import Sample, groups_of
from slime_spec.rollout.sampling_params import sampling_params


def test_generate_payload_matches_sglang():
    sent = []

    class RecordingClient:
        async def generate(self, payload):
            sent.append(payload)
            return {"text": "a", "output_ids": [9],
                    "meta_info": {"completion_tokens": 1, "finish_reason": {"type": "stop"},
                                  "output_token_logprobs": [[-0.5, 9, None]]}}

    cfg = RolloutConfig(hf_checkpoint="x", rollout_max_response_len=8)
    sample = asyncio.run(default_generate(RecordingClient(), Sample(index=0, group_index=0, prompt="p", tokens=[4, 5]),
                                          sampling_params(cfg)))
    validate_payload("GenerateReqInput", sent[0])
    assert sent[0]["input_ids"] == [4, 5] and sent[0]["return_logprob"] is True
    assert sample.tokens == [4, 5, 9] and sample.rollout_log_probs == [-0.5]


def test_sample_records_the_weight_version_of_the_answer():
    s = Sample(index=0, group_index=0, prompt="p", tokens=[1])
    assert s.weight_version is None
    apply_generate_output(s, {"output_ids": [2], "meta_info": {"completion_tokens": 1, "weight_version": "7",
                                                               "finish_reason": {"type": "stop"}}})
    assert s.weight_version == "7"
    assert Sample.from_dict(s.to_dict()).weight_version == "7"


def _answer(token: int) -> dict:
    return {"text": "a", "output_ids": [token],
            "meta_info": {"completion_tokens": 1, "finish_reason": {"type": "stop"}, "weight_version": "3",
                          "output_token_logprobs": [[-0.25, token, None]]}}


def test_a_group_is_one_batched_request_sglang_accepts():
    sent = []

    class RecordingClient:
        async def generate_batch(self, payload):
            sent.append(payload)
            return [_answer(10 + i) for i in range(len(payload["input_ids"]))]

    params = sampling_params(RolloutConfig(hf_checkpoint="x", rollout_max_response_len=8))
    group = [Sample(index=i, group_index=0, prompt="p", tokens=[4, 5]) for i in range(3)]
    group[2].tokens, group[2].response_length = [4, 5, 6], 1  # a partial response continued: one token fewer
    body = group_request(group, params)
    validate_payload("GenerateReqInput", body)
    assert body["input_ids"] == [[4, 5], [4, 5], [4, 5, 6]]
    assert [p["max_new_tokens"] for p in body["sampling_params"]] == [8, 8, 7]
    out = asyncio.run(default_generate_group(RecordingClient(), group, body))
    assert len(sent) == 1 and out is group
    assert [s.tokens for s in out] == [[4, 5, 10], [4, 5, 11], [4, 5, 6, 12]]
    assert all(s.rollout_log_probs == [-0.25] and s.weight_version == "3" for s in out)


def test_a_group_falls_back_to_one_request_per_sample_where_it_must():
    params = sampling_params(RolloutConfig(hf_checkpoint="x", rollout_max_response_len=8))
    group = [Sample(index=i, group_index=0, prompt="p", tokens=[4]) for i in range(2)]
    group[1].metadata["request_extension"] = {"history_sync": {"id": 1}}  # history drafting: fields of its own
    assert group_request(group, params) is None
    group[1].metadata.clear()
    group[1].response_length = 8  # nothing left to generate: default_generate marks it truncated
    assert group_request(group, params) is None


def test_a_batched_answer_of_the_wrong_length_is_an_error():
    class ShortClient:
        async def generate_batch(self, payload):
            return [_answer(1)]

    group = [Sample(index=i, group_index=0, prompt="p", tokens=[4]) for i in range(2)]
    body = group_request(group, {"max_new_tokens": 4})
    with pytest.raises(ValueError, match="batched /generate of 2 inputs was answered with 1 outputs"):
        asyncio.run(default_generate_group(ShortClient(), group, body))


def test_groups_of_cuts_consecutive_group_indices():
    samples = [Sample(index=i, group_index=g, prompt="p", tokens=[1]) for i, g in enumerate([0, 0, 1, 1, 1, 4])]
    assert [[s.index for s in g] for g in groups_of(samples)] == [[0, 1], [2, 3, 4], [5]]
