"""EngineActor's control routes send SGLang's own payloads; answers are parsed without hiding failures."""

import asyncio

import pytest

from slime_spec.config import RolloutConfig
from slime_spec.rollout.engine_actor import Engine, EngineHTTPError, parse_response
from slime_spec.rollout.generate import default_generate
from slime_spec.rollout.sample import Sample
from slime_spec.rollout.sampling_params import sampling_params
from slime_spec.sglang_contract import validate_payload

ROUTE_STRUCTS = {
    "/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq", "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput", "/end_weight_update": "EndWeightUpdateReqInput",
    "/generate": "GenerateReqInput",
}


def _recording_engine():
    engine = Engine.__new__(Engine)  # no server: record what each helper would POST
    calls = []
    engine.post = lambda path, payload=None, timeout=None: calls.append((path, payload)) or {}
    return engine, calls


def test_control_payloads_match_sglang_io_structs():
    engine, calls = _recording_engine()
    engine.pause_generation()
    engine.continue_generation()
    engine.abort_request()
    engine.abort_request("rid-1")
    engine.release_memory_occupation(["kv_cache"])
    engine.resume_memory_occupation()
    engine.begin_weight_update("draft")
    engine.end_weight_update()
    assert [p for p, _ in calls] == ["/pause_generation", "/continue_generation", "/abort_request", "/abort_request",
                                     "/release_memory_occupation", "/resume_memory_occupation",
                                     "/begin_weight_update", "/end_weight_update"]
    for path, payload in calls:
        validate_payload(ROUTE_STRUCTS[path], payload or {})
    assert calls[2][1] == {"abort_all": True} and calls[6][1] == {"selector": "draft"}


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


def test_parse_response():
    assert parse_response("u", 200, "") == {}
    assert parse_response("u", 200, "Cache flushed.\n") == {"text": "Cache flushed.\n"}
    assert parse_response("u", 200, '{"success": true, "message": "ok"}') == {"success": True, "message": "ok"}
    with pytest.raises(EngineHTTPError, match="HTTP 400"):
        parse_response("u", 400, '{"error": {"message": "bad"}}')
    with pytest.raises(EngineHTTPError, match="must run between"):  # a 200 that says it failed is a failure
        parse_response("u", 200, '{"success": false, "message": "must run between begin and end"}')
