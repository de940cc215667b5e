"""Every request body we send to SGLang, built into SGLang 0.5.23's own io_struct class by the same
pydantic path its FastAPI routes use (sglang_io.py), and /generate bodies through SGLang's own
request checks (contract check, GenerateReqInput normalization, SamplingParams verify).

Bodies are captured from the code that sends them (protocol.py, the rollout Engine's HTTP methods,
default_generate, the acceptance canary), not retyped here.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from slime_spec.config.run_config import RolloutConfig
from slime_spec.fleet.actor import Engine
from slime_spec.rollout.generate import batched_body, default_generate, group_request
from slime_spec.rollout.sample import Sample
from slime_spec.rollout.sampling_params import sampling_params
from slime_spec.weight_sync import protocol
from slime_spec.weight_sync.transports.tensor_payload import serialize_named_tensors
from slime_spec.weight_sync.verify.canary import AcceptanceCanary
from tests.conformance.sglang_io import build, build_generate

VOCAB = 151680


def protocol_bodies(session: bool) -> list[tuple[str, dict]]:
    tensors = serialize_named_tensors([("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.zeros(2, 4))])
    common = dict(weight_version="v3", session=session)
    return [
        ("/begin_weight_update", protocol.begin_payload("target")),
        ("/end_weight_update", protocol.end_payload()),
        ("/init_weights_update_group", protocol.init_group_payload("10.0.0.1", 29500, 1, 9, "wug", "nccl")),
        ("/destroy_weights_update_group", protocol.destroy_group_payload("wug")),
        ("/update_weights_from_distributed", protocol.distributed_payload(
            ["model.norm.weight", "lm_head.weight"], ["bfloat16", "float32"], [[4], [2, 4]], group_name="wug",
            selector="all", flush_cache=False, **common)),
        ("/update_weights_from_tensor", protocol.tensor_payload([tensors, tensors], selector="draft",
                                                                flush_cache=False, **common)),
        ("/update_weights_from_disk", protocol.disk_payload("/ckpt/step_3", **common)),
        ("/weights_checker", protocol.checksum_payload("all", session)),
        ("/get_weights_by_name", protocol.get_weights_payload("model.norm.weight", 4)),
        *[("/pause_generation", protocol.pause_payload(mode)) for mode in ("abort", "retract", "in_place")],
        ("/continue_generation", protocol.continue_payload()),
        ("/update_weight_version", protocol.weight_version_payload("v3")),
    ]


@pytest.mark.parametrize("session", [True, False], ids=["session", "sessionless"])
def test_weight_sync_bodies_build_sglangs_structs(session):
    for route, body in protocol_bodies(session):
        req = build(protocol.ROUTE_STRUCTS[route], body)
        for key, value in body.items():
            if key != "serialized_named_tensors":  # SGLang decodes the base64 strings to bytes
                assert getattr(req, key) == value, (route, key)


def test_every_weight_sync_route_is_covered():
    assert {route for route, _ in protocol_bodies(True)} == set(protocol.ROUTE_STRUCTS)


def test_selector_defaults_to_all_when_a_sessionless_body_omits_it():
    for route, body in protocol_bodies(False):
        req = build(protocol.ROUTE_STRUCTS[route], body)
        if hasattr(req, "selector") and "selector" not in body:
            assert req.selector == "all", route


def test_a_body_sglang_would_refuse_is_refused():
    with pytest.raises(Exception, match="selector"):
        build("BeginWeightUpdateReqInput", {"selector": "drafts"})
    with pytest.raises(ValueError, match="would drop them silently"):
        build("UpdateWeightsFromDistributedReqInput", {"names": [], "dtypes": [], "shapes": [], "selectr": "all"})
    with pytest.raises(Exception, match="base64"):
        build("UpdateWeightsFromTensorReqInput", {"serialized_named_tensors": ["not base64!"]})


class RecordingEngine(Engine):
    """The rollout Engine's HTTP methods with `post` recording the body instead of sending it (test double)."""

    def __init__(self):
        self.sent: list[tuple[str, dict]] = []

    def post(self, path, payload=None, timeout=None):
        self.sent.append((path, payload if payload is not None else {}))
        return {}


ENGINE_ROUTE_STRUCTS = {**protocol.ROUTE_STRUCTS, "/abort_request": "AbortReq",
                        "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
                        "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
                        # SGLang's route reads no body (only a `timeout` query): the flush before a release sends none
                        "/flush_cache": "FlushCacheReqInput"}


def test_rollout_engine_bodies_build_sglangs_structs():
    engine = RecordingEngine()
    engine.abort_request("req-7")
    engine.abort_request()
    for tags in (["weights"], ["kv_cache", "weights"], None):
        engine.release_memory_occupation(tags)
        engine.resume_memory_occupation(tags)
    for mode in ("abort", "retract", "in_place"):
        engine.pause_generation(mode)
    engine.continue_generation()
    engine.begin_weight_update("target")
    engine.end_weight_update()
    for path, body in engine.sent:
        assert path != "/flush_cache" or body == {}, body
        req = build(ENGINE_ROUTE_STRUCTS[path], body)
        assert all(getattr(req, k) == v for k, v in body.items()), path


class RecordingClient:
    """A /generate client that records the body and answers like SGLang (test double)."""

    url = "http://engine"

    def __init__(self):
        self.bodies: list[dict] = []

    def _reply(self, body):
        self.bodies.append(body)
        return {"text": "", "output_ids": [5], "meta_info": {
            "finish_reason": {"type": "length"}, "prompt_tokens": len(body["input_ids"]), "completion_tokens": 1,
            "output_token_logprobs": [[-0.5, 5, None]], "spec_verify_ct": 1}}

    async def generate(self, body):
        return self._reply(body)

    def post(self, path, body):  # the blocking client: a batch answers a JSON list (client.parse_response's form)
        assert path == "/generate"
        if body["input_ids"] and isinstance(body["input_ids"][0], list):
            self.bodies.append(body)
            return {"result": [self._reply({**body, "input_ids": ids}) for ids in body["input_ids"]]}
        return self._reply(body)


ROLLOUT_CONFIGS = [
    RolloutConfig(hf_checkpoint="m"),
    RolloutConfig(hf_checkpoint="m", rollout_temperature=0.8, rollout_top_p=0.7, rollout_top_k=20,
                  rollout_max_response_len=8192, rollout_stop=("</answer>",), rollout_stop_token_ids=(151643,),
                  rollout_skip_special_tokens=True),
    RolloutConfig(hf_checkpoint="m", rollout_temperature=0.0),
]


@pytest.mark.parametrize("cfg", ROLLOUT_CONFIGS, ids=["defaults", "script-like", "greedy"])
def test_rollout_generate_body_passes_sglangs_request_checks(cfg):
    client = RecordingClient()
    sample = Sample(index=0, group_index=0, prompt="p", tokens=[11, 12, 13])
    asyncio.run(default_generate(client, sample, sampling_params(cfg)))
    req, params = build_generate(client.bodies[0], VOCAB)
    assert req.input_ids == [11, 12, 13] and req.return_logprob is True
    assert req.sampling_params == client.bodies[0]["sampling_params"]
    assert params.max_new_tokens == cfg.rollout_max_response_len
    if cfg.rollout_temperature == 0:
        assert params.top_k == 1  # SGLang reads temperature 0 as greedy


@pytest.mark.parametrize("cfg", ROLLOUT_CONFIGS, ids=["defaults", "script-like", "greedy"])
def test_a_groups_batched_generate_body_passes_sglangs_request_checks(cfg):
    group = [Sample(index=i, group_index=0, prompt="p", tokens=[11, 12, 13]) for i in range(3)]
    group[2].tokens, group[2].response_length = [11, 12, 13, 14], 1  # a partial response continued
    req, params = build_generate(group_request(group, sampling_params(cfg)), VOCAB)
    assert req.batch_size == 3 and req.input_ids == [[11, 12, 13], [11, 12, 13], [11, 12, 13, 14]]
    assert [sp["max_new_tokens"] for sp in req.sampling_params] == [cfg.rollout_max_response_len] * 2 + [
        cfg.rollout_max_response_len - 1]
    assert req.return_logprob == [True] * 3  # SGLang's normalization spreads the batch's flag to each input


def test_the_speedup_probes_batched_body_passes_sglangs_request_checks():
    """The spec_speedup probe sends a group with one sampling_params for all its inputs: SGLang's normalization gives
    every input that dict."""
    params = sampling_params(ROLLOUT_CONFIGS[1])
    req, _ = build_generate(batched_body([[11, 12, 13], [14, 15]], dict(params)), VOCAB)
    assert req.batch_size == 2 and req.sampling_params == [params, params] and req.return_logprob == [True, True]


def test_canary_generate_body_passes_sglangs_request_checks():
    client = RecordingClient()
    canary = AcceptanceCanary(protocol.SpecSetup(algorithm="EAGLE"), max_new_tokens=16)
    canary.set_probe_from_samples([[1, 2, 3, 4], [5, 6]])
    canary._probe_engine(client)
    req, params = build_generate(client.bodies[0], VOCAB)
    assert req.batch_size == 2 and req.input_ids == [[1, 2, 3, 4], [5, 6]]  # one batched request
    assert params.top_k == 1 and params.ignore_eos is True and params.max_new_tokens == 16


def test_a_generate_body_sglang_would_refuse_is_refused():
    with pytest.raises(ValueError):
        build_generate({"input_ids": [1, 2], "sampling_params": {"temperature": -1.0, "max_new_tokens": 4}}, VOCAB)


def test_history_corpus_bodies_build_sglangs_structs():
    """The corpus calls of history drafting (fleet/client.py) are SGLang 0.5.23's own structs, and carry
    `documents`: its HTTP route refuses an AddExternalCorpusReqInput with only `token_chunks`."""
    from slime_spec.fleet.client import add_corpus_payload, remove_corpus_payload
    add = build("AddExternalCorpusReqInput", add_corpus_payload("slime-history/all/3", ["a b", "c"]))
    assert add.corpus_id == "slime-history/all/3" and add.documents == ["a b", "c"] and add.token_chunks is None
    assert build("RemoveExternalCorpusReqInput", remove_corpus_payload("x")).corpus_id == "x"
    build("ListExternalCorporaReqInput", {})


def test_history_extension_is_never_sent_to_real_sglang():
    """`slime_history` is a slime-spec extension: SGLang's GenerateReqInput rejects it, so only the embedded
    engine's /generate may carry it (history_sync tags samples for backend embedded only)."""
    import asyncio

    from slime_spec.rollout.history import HistoryStore
    from slime_spec.rollout.history_sync import HistorySync
    with pytest.raises(Exception):
        build_generate({"input_ids": [1, 2], "slime_history": {"group": "g"}}, VOCAB)
    s = Sample(index=0, group_index=0, prompt="p", tokens=[1, 2])
    asyncio.run(HistorySync(HistoryStore(1, 10), "sglang", 100).before_rollout([], [s], 0))
    payloads = []

    class Recorder:
        async def generate(self, payload):
            payloads.append(payload)
            return {"output_ids": [3], "text": "x", "meta_info": {"finish_reason": {"type": "length"}}}

    asyncio.run(default_generate(Recorder(), s, {"max_new_tokens": 4}))
    assert "slime_history" not in payloads[0]
    build_generate(payloads[0], VOCAB)
