"""rollout/generate.py: the default generate function's payload, and what one answer adds to a sample."""

import asyncio

from slime_spec.config.run_config import RolloutConfig
from slime_spec.fleet.sglang_contract import validate_payload
from slime_spec.rollout.generate import apply_generate_output, default_generate
from slime_spec.rollout.sample import Sample
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
