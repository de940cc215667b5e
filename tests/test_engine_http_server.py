"""The embedded engine over real HTTP: SGLang 0.5.23's own front end (routes, validation, auth, OpenAI serving)
in front of our scheduler process. Where an answer below is SGLang's, it is asserted as SGLang gives it.

Two servers on one tiny MiMo checkpoint, started once for the module: `plain` (no speculation, an API key,
SGLANG_HEALTH_CHECK_TIMEOUT=5 so a health probe that gets no answer fails quickly) and `spec` (EAGLE with the
checkpoint's MTP layer).
"""

import threading
import time

import pytest
import requests

from slime_spec.fleet.process import embedded_server_process
from slime_spec.tools.tiny_model import make_tiny_model

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT_LENGTH = 1024  # make_tiny_model's max_position_embeddings
PROMPTS = ["hello world", "the cat sat on", "abc abc abc", "0123", "zz", "Once upon a time", "q", "RL is fun"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_server")
    model = make_tiny_model(root / "mimo", arch="mimo", hidden_size=32, num_layers=2, seed=3)
    plain = embedded_server_process(model, ["--api-key", KEY, "--random-seed", "0", "--max-running-requests", "8"],
                                    log_path=root / "plain.log", env={"SGLANG_HEALTH_CHECK_TIMEOUT": "5"}).launch()
    spec = embedded_server_process(model, ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                                 "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
                                 "--random-seed", "0", "--mem-fraction-static", "0.7", "--skip-server-warmup"],
                                   log_path=root / "spec.log").launch()
    try:
        yield plain.wait_ready(300), spec.wait_ready(300)
    finally:
        plain.stop()
        spec.stop()


@pytest.fixture(scope="module")
def plain(servers):
    return servers[0]


@pytest.fixture(scope="module")
def spec(servers):
    return servers[1]


def post(server, path, body=None, headers=AUTH, **kw):
    return requests.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def generate(server, body, headers=AUTH):
    r = post(server, "/generate", body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(n):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def poll(fn, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def load(server, headers=AUTH):
    return requests.get(server.url + "/server_info", headers=headers, timeout=10).json()["internal_states"][0]


def test_generate_single_text_and_input_ids(plain):
    out = generate(plain, {"text": "hello", "sampling_params": greedy(6), "rid": "r1"})
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 6
    assert meta["weight_version"] == "default" and meta["e2e_latency"] > 0
    assert not any(k.startswith("spec_") for k in meta)  # SGLang sends no spec keys without speculation
    ids = generate(plain, {"text": "hello", "sampling_params": greedy(0)})
    assert ids["output_ids"] == [] and ids["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    by_ids = generate(plain, {"input_ids": [1, 10, 11, 12, 13, 14],
                              "sampling_params": greedy(4), "return_prompt_token_ids": True})
    assert by_ids["prompt_token_ids"] == [1, 10, 11, 12, 13, 14] and len(by_ids["output_ids"]) == 4


def test_batch_and_parallel_sampling(plain):
    outs = generate(plain, {"text": PROMPTS[:3], "sampling_params": [greedy(3), greedy(5), greedy(7)],
                            "rid": ["a", "b", "c"]})
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b", "c"]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 5, 7]
    single = [generate(plain, {"text": p, "sampling_params": greedy(5)})["output_ids"] for p in PROMPTS[:3]]
    batch = generate(plain, {"text": PROMPTS[:3], "sampling_params": greedy(5)})
    assert [o["output_ids"] for o in batch] == single
    par = generate(plain, {"text": "abc", "sampling_params": {"temperature": 1.0, "max_new_tokens": 4, "n": 3}})
    assert isinstance(par, list) and len(par) == 3 and len({o["meta_info"]["id"] for o in par}) == 3


def test_greedy_equal_with_and_without_speculation(plain, spec):
    body = {"text": PROMPTS, "sampling_params": greedy(24), "return_logprob": True}
    base, fast = generate(plain, body), generate(spec, body, headers={})
    assert [o["output_ids"] for o in fast] == [o["output_ids"] for o in base]
    for b, f in zip(base, fast):
        assert [x[0] for x in f["meta_info"]["output_token_logprobs"]] == pytest.approx(
            [x[0] for x in b["meta_info"]["output_token_logprobs"]], abs=1e-4)
        m = f["meta_info"]
        assert m["spec_verify_ct"] > 0
        assert m["spec_accept_length"] == pytest.approx(m["completion_tokens"] / m["spec_verify_ct"])
        # SGLang's TokenizerManager: proposed = verify passes x (--speculative-num-draft-tokens - 1)
        assert m["spec_num_proposed_drafts"] == 3 * m["spec_verify_ct"]
        assert 0 <= m["spec_num_correct_drafts"] <= m["spec_num_proposed_drafts"]
        assert m["spec_accept_rate"] == pytest.approx(m["spec_num_correct_drafts"] / m["spec_num_proposed_drafts"])
    assert load(spec, headers={})["avg_spec_accept_length"] >= 1.0
    assert "avg_spec_accept_length" not in load(plain)
    times, state = load(spec, headers={})["spec_step_times"], load(spec, headers={})
    assert times["draft_s"] > 0 and times["verify_s"] > 0 and times["sampling_s"] > 0
    assert 0 < sum(times.values()) <= state["engine_step_s"]  # phases of the steps, inside the steps' time
    assert load(plain)["engine_step_s"] > 0 and "spec_step_times" not in load(plain)


def test_logprobs_shape(plain):
    out = generate(plain, {"text": "abc", "sampling_params": greedy(5), "return_logprob": True,
                           "return_text_in_logprobs": True})
    meta = out["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 5
    for (lp, tok, text), t in zip(meta["output_token_logprobs"], out["output_ids"]):
        assert lp <= 0 and tok == t and isinstance(text, str)
    plain_meta = generate(plain, {"text": "abc", "sampling_params": greedy(2), "return_logprob": True})["meta_info"]
    assert all(entry[2] is None for entry in plain_meta["output_token_logprobs"])


def test_stop_conditions(plain):
    params = {"temperature": 0, "max_new_tokens": 12}  # SGLang's ignore_eos also ignores stop_token_ids
    free = generate(plain, {"text": "stop test", "sampling_params": params})
    assert len(free["output_ids"]) >= 4
    second = free["output_ids"][1]
    by_token = generate(plain, {"text": "stop test", "sampling_params": {**params, "stop_token_ids": [second]}})
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": second}
    assert by_token["output_ids"] == free["output_ids"][:2]
    stop_str = free["text"][2:4]
    by_str = generate(plain, {"text": "stop test", "sampling_params": {**params, "stop": [stop_str]}})
    assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert stop_str not in by_str["text"]


BAD_BODIES = [  # (body, what SGLang's answer says); every one a 400 that leaves the server serving
    ({}, "Either text, input_ids"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature must be"),
    ({"text": "a", "sampling_params": {"top_p": 2.0}}, "top_p must be in (0, 1]"),
    ({"text": "a", "sampling_params": {"not_a_param": 1}}, "unknown field `not_a_param`"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, 'invalid type: string "hot", expected f64'),
    ({"text": "a", "sampling_params": {"repetition_penalty": 1.5}}, "sampling_params.repetition_penalty"),
    ({"input_ids": [1, 100000]}, "outside the vocabulary"),
    ({"input_ids": [5] * 1030}, "longer than the model's context length"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 5000}}, "exceeds the model's maximum context length"),
    ({"text": ["a", "b"], "rid": ["only-one"]}, "rids length mismatch"),
    ({"text": "a", "top_logprobs_num": 3, "return_logprob": True}, "top_logprobs_num"),
    ({"text": 5}, "Input should be a valid string"),
    ({"input_ids": [[1], 2]}, "must be list"),
]

BAD_CONTROL_BODIES = [  # SGLang's request structs refuse these before anything reaches the engine
    ("/update_weight_version", {"new_version": {"a": 1}}, "new_version"),
    ("/update_weights_from_disk", {"model_path": 5}, "model_path"),
    ("/release_memory_occupation", {"tags": "weights"}, "tags"),
    ("/abort_request", {"rid": 5}, "rid"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": "x", "rank_offset": 1, "world_size": 2},
     "master_port"),
    ("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": "x"}, "truncate_size"),
    ("/update_weights_from_distributed", {"names": ["x"]}, "UpdateWeightsFromDistributedReqInput"),
    ("/pause_generation", {"mode": "sideways"}, "sideways"),
]


def error_message(r) -> str:
    body = r.json()
    error = body.get("error", body.get("message"))
    return error["message"] if isinstance(error, dict) else str(error)


def test_bad_requests_get_sglangs_400_and_the_server_keeps_serving(plain):
    for body, needle in BAD_BODIES:
        r = post(plain, "/generate", body)
        assert r.status_code == 400 and needle in error_message(r), (body, r.text)
    for path, body, needle in BAD_CONTROL_BODIES:
        r = post(plain, path, body)
        assert r.status_code == 400 and needle in error_message(r), (path, body, r.text)
    r = requests.post(plain.url + "/generate", data=b"{not json", headers={**AUTH, "content-type": "application/json"},
                      timeout=10)
    assert r.status_code == 400 and "JSON decode error" in error_message(r)
    r = requests.post(plain.url + "/flush_cache?timeout=abc", headers=AUTH, timeout=10)
    assert r.status_code == 400 and "timeout" in error_message(r)
    r = post(plain, "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]})
    assert r.status_code == 400 and "between begin_weight_update() and end_weight_update()" in r.json()["message"]
    assert requests.get(plain.url + "/health_generate", timeout=30).status_code == 200
    assert generate(plain, {"text": "still alive", "sampling_params": greedy(3)})["meta_info"]["completion_tokens"] == 3


def test_info_endpoints(plain):
    assert requests.get(plain.url + "/health", timeout=30).status_code == 200
    assert requests.get(plain.url + "/health_generate", timeout=30).status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = requests.get(plain.url + path, headers=AUTH, timeout=10).json()
        assert info["model_type"] == "mimo" and info["architectures"] == ["MiMoForCausalLM"]
        assert info["is_generation"] is True and info["weight_version"] == "default"
    for path in ("/get_server_info", "/server_info"):
        info = requests.get(plain.url + path, headers=AUTH, timeout=10).json()
        assert info["version"] == "0.5.23" and info["tp_size"] == 1 and info["device"] == expected_device()
        assert "--model-path" in info["launch_command"]  # SGLang's build_server_info
        state = info["internal_states"][0]
        assert "last_gen_throughput" in state and state["engine_step_s"] > 0  # ours: seconds inside engine steps


def test_a_prompt_of_max_req_input_len_tokens_is_refused_as_sglangs_scheduler_refuses_it(plain):
    """SGLang's TpModelWorker sets max_req_input_len = context length - 1 - 5 and its scheduler refuses a prompt of
    that many tokens or more (validate_input_length), below the TokenizerManager's own context check."""
    info = requests.get(plain.url + "/server_info", headers=AUTH, timeout=10).json()
    limit = info["max_req_input_len"]
    assert limit == CONTEXT_LENGTH - 6, info
    ok = generate(plain, {"input_ids": [5] * (limit - 1), "sampling_params": greedy(1)})
    assert ok["meta_info"]["prompt_tokens"] == limit - 1 and ok["meta_info"]["completion_tokens"] == 1
    r = post(plain, "/generate", {"input_ids": [5] * limit, "sampling_params": greedy(1)})
    assert r.status_code == 400, r.text
    assert f"Input length ({limit} tokens) exceeds the maximum allowed length ({limit} tokens)" in error_message(r)
    assert generate(plain, {"text": "a", "sampling_params": greedy(2)})["meta_info"]["completion_tokens"] == 2


def test_openai_compatible_routes(plain):
    """SGLang's own OpenAI serving, in front of our engine."""
    done = post(plain, "/v1/completions", {"model": plain.expect_model_path, "prompt": "hello", "max_tokens": 4,
                                           "temperature": 0}).json()
    assert done["object"] == "text_completion" and done["usage"]["completion_tokens"] == 4
    plain_ids = generate(plain, {"text": "hello", "sampling_params": greedy(4)})["text"]
    assert done["choices"][0]["text"] == plain_ids  # the same greedy tokens as /generate
    chat = post(plain, "/v1/chat/completions", {"model": plain.expect_model_path, "max_tokens": 3,
                                                "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] <= 3
    models = requests.get(plain.url + "/v1/models", headers=AUTH, timeout=10).json()
    assert models["data"][0]["id"] == plain.expect_model_path
    with requests.post(plain.url + "/generate", json={"text": "hello", "sampling_params": greedy(5), "stream": True},
                       headers=AUTH, timeout=60, stream=True) as r:
        chunks = [line for line in r.iter_lines() if line.startswith(b"data:")]
    assert r.status_code == 200 and chunks[-1] == b"data: [DONE]" and len(chunks) >= 2


def stream(server, body, headers):
    """The JSON chunks of a streamed /generate (SGLang's SSE lines, `[DONE]` dropped)."""
    import json

    with requests.post(server.url + "/generate", json={**body, "stream": True}, headers=headers, timeout=60,
                       stream=True) as r:
        assert r.status_code == 200, r.text
        lines = [line for line in r.iter_lines() if line.startswith(b"data:")]
    assert lines[-1] == b"data: [DONE]"
    return [json.loads(line[len(b"data:"):]) for line in lines[:-1]]


@pytest.mark.parametrize("name", ["plain", "spec"])
def test_generate_streams_step_by_step(servers, name):
    """As SGLang's scheduler with --stream-interval 1: a chunk after every engine step that produced tokens, each
    one SGLang's text and ids so far, the last equal to the request's non-streamed answer (greedy, and with logprobs).
    Text that may be the start of a stop string is held back, so no chunk shows what the end trims."""
    server, headers = (servers[0], AUTH) if name == "plain" else (servers[1], {})
    body = {"text": "hello", "sampling_params": greedy(12), "return_logprob": True}
    whole = generate(server, body, headers=headers)
    chunks = stream(server, body, headers)
    lengths = [len(c["output_ids"]) for c in chunks]
    assert len(chunks) >= 4 and lengths == sorted(set(lengths)) and lengths[-1] == 12  # incremental, not one chunk
    assert all(whole["text"].startswith(c["text"]) for c in chunks)
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 12
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    # a request's own stream_interval: the first tokens at once, then at least 4 new tokens a chunk, then the end
    sparse = [len(c["output_ids"]) for c in stream(server, {**body, "sampling_params": {**greedy(12),
                                                                                          "stream_interval": 4}},
                                                   headers)]
    assert len(sparse) < len(lengths) and sparse[-1] == 12
    assert all(b - a >= 4 for a, b in zip(sparse, sparse[1:-1]))

    stop = whole["text"][5:8]  # a stop string from inside the greedy text: its start is streamed, then trimmed
    body = {"text": "hello", "sampling_params": {"temperature": 0, "max_new_tokens": 30, "stop": [stop]}}
    stopped = generate(server, body, headers=headers)
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    chunks = stream(server, body, headers)
    assert chunks[-1]["text"] == stopped["text"] and all(stopped["text"].startswith(c["text"]) for c in chunks)


def test_api_key(plain):
    r = requests.post(plain.url + "/generate", json={"text": "a"}, timeout=10)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    r = requests.post(plain.url + "/flush_cache", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    assert requests.get(plain.url + "/health", timeout=30).status_code == 200
    assert post(plain, "/flush_cache").status_code == 200


def _in_thread(fn):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()))
    thread.start()
    return thread, result


def test_pause_in_place_holds_running_requests_and_abort_by_rid(plain):
    """SGLang's in-place pause keeps running requests where they are; an abort of one of them ends it at the next
    step, which runs after continue_generation (SGLang's scheduler: `to_finish`, one more decode pass)."""
    reference = generate(plain, {"text": "wait", "sampling_params": greedy(700)})
    held, res_w = _in_thread(lambda: generate(plain, {"text": "wait", "sampling_params": greedy(700), "rid": "w"}))
    aborted, res_a = _in_thread(lambda: generate(plain, {"text": "go", "sampling_params": greedy(700), "rid": "x"}))
    poll(lambda: load(plain)["num_running_reqs"] == 2)
    assert post(plain, "/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
    assert post(plain, "/abort_request", {"rid": "x"}).status_code == 200
    assert held.is_alive() and aborted.is_alive()
    assert post(plain, "/continue_generation", {}).json()["status"] == "ok"
    aborted.join(timeout=60)
    held.join(timeout=60)
    assert res_a["value"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(res_a["value"]["output_ids"]) < 700
    assert res_w["value"]["output_ids"] == reference["output_ids"]  # greedy: the pause is invisible


def test_pause_abort_and_retract(plain):
    long_body = {"text": "long", "sampling_params": greedy(900), "rid": "long"}
    thread, res = _in_thread(lambda: generate(plain, long_body))
    poll(lambda: load(plain)["num_running_reqs"] == 1)
    assert post(plain, "/pause_generation", {}).status_code == 200  # default mode: abort
    thread.join(timeout=30)
    assert res["value"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(plain, "/continue_generation", {}).status_code == 200

    reference = generate(plain, {**long_body, "sampling_params": greedy(600)})
    thread, res = _in_thread(lambda: generate(plain, {**long_body, "sampling_params": greedy(600)}))
    poll(lambda: load(plain)["num_running_reqs"] == 1)
    assert post(plain, "/pause_generation", {"mode": "retract"}).status_code == 200
    assert post(plain, "/flush_cache").status_code == 200  # retracted requests hold no cache
    assert post(plain, "/continue_generation", {}).status_code == 200
    thread.join(timeout=60)
    assert res["value"]["output_ids"] == reference["output_ids"]  # greedy: retraction is invisible
    assert res["value"]["meta_info"]["finish_reason"] == {"type": "length", "length": 600}


def test_flush_refused_while_requests_hold_the_cache(plain):
    thread, res = _in_thread(lambda: generate(plain, {"text": "busy", "sampling_params": greedy(900)}))
    poll(lambda: load(plain)["num_running_reqs"] == 1)
    assert post(plain, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        r = post(plain, "/flush_cache")
        assert r.status_code == 400 and r.text == "Flush cache failed.\n"  # SGLang's answer
    finally:
        assert post(plain, "/continue_generation", {}).status_code == 200
    thread.join(timeout=60)
    assert res["value"]["meta_info"]["completion_tokens"] == 900


def test_release_resume_memory_and_weight_version(spec):
    before = generate(spec, {"text": PROMPTS[:2], "sampling_params": greedy(8)}, headers={})
    assert post(spec, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]}, headers={}).status_code == 200
    assert post(spec, "/resume_memory_occupation", {}, headers={}).status_code == 200
    after = generate(spec, {"text": PROMPTS[:2], "sampling_params": greedy(8)}, headers={})
    assert [o["output_ids"] for o in after] == [o["output_ids"] for o in before]
    assert [o["meta_info"]["spec_num_correct_drafts"] for o in after] == \
        [o["meta_info"]["spec_num_correct_drafts"] for o in before]
    r = post(spec, "/update_weight_version", {"new_version": "v7", "abort_all_requests": False}, headers={})
    assert r.json() == {"success": True, "message": "Weight version updated to v7", "new_version": "v7"}
    assert requests.get(spec.url + "/model_info", timeout=10).json()["weight_version"] == "v7"
    # SGLang's /server_info is the start-up configuration: the live version is /model_info's
    assert requests.get(spec.url + "/server_info", timeout=10).json()["weight_version"] == "default"
    meta = generate(spec, {"text": "a", "sampling_params": greedy(1)}, headers={})["meta_info"]
    assert meta["weight_version"] == "v7"


def test_performance_only_flags_are_logged_once(spec):
    log = spec.log_path.read_text()
    assert log.count("accepted and ignored") == 1 and "--mem-fraction-static=0.7" in log


def test_a_client_that_disconnects_aborts_its_request(plain):
    with pytest.raises(requests.Timeout):
        requests.post(plain.url + "/generate", json={"text": "bye", "sampling_params": greedy(900)}, headers=AUTH,
                      timeout=0.5)
    poll(lambda: load(plain)["num_running_reqs"] == 0 and load(plain)["num_waiting_reqs"] == 0)


def test_generate_while_memory_is_released_is_refused_not_held(plain):
    assert post(plain, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    try:
        r = post(plain, "/generate", {"text": "a", "sampling_params": greedy(2)})
        assert r.status_code == 503 and "/resume_memory_occupation" in error_message(r)
    finally:
        assert post(plain, "/resume_memory_occupation", {}).status_code == 200
    assert requests.get(plain.url + "/health", timeout=30).status_code == 200
    assert generate(plain, {"text": "back", "sampling_params": greedy(2)})["meta_info"]["completion_tokens"] == 2


def test_health_while_paused_is_sglangs(plain):
    """SGLang holds a paused server's health probe at its pause gate until SGLANG_HEALTH_CHECK_TIMEOUT (5 s here):
    503; /ready says 503 at once, /ping (liveness) 200."""
    assert post(plain, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        assert requests.get(plain.url + "/ready", timeout=10).status_code == 503
        assert requests.get(plain.url + "/ping", headers=AUTH, timeout=10).status_code == 200
        assert requests.get(plain.url + "/health", timeout=30).status_code == 503
    finally:
        assert post(plain, "/continue_generation", {}).status_code == 200
    assert requests.get(plain.url + "/health", timeout=30).status_code == 200


def test_the_generating_liveness_probe_through_sglangs_front_end(plain):
    """The loop's probe before a rollout, eval or sync: one token through SGLang's /generate. A serving engine
    passes; a paused one holds the request (a hang past the bound); a released one refuses it (503)."""
    from slime_spec.fleet.client import EngineAuth, EngineClient
    client = EngineClient(plain.url, EngineAuth(api_key=KEY))
    assert client.liveness_problem(generate=True) is None
    assert post(plain, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        assert client.liveness_problem(generate=True, timeout_s=1) == "/generate did not answer within 1 s (hung)"
        assert client.liveness_problem(generate=False) is None  # /ping: alive while paused
    finally:
        assert post(plain, "/continue_generation", {}).status_code == 200
    poll(lambda: load(plain)["num_running_reqs"] == 0 and load(plain)["num_waiting_reqs"] == 0)
    assert post(plain, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    try:
        assert client.liveness_problem(generate=True) == "/generate answered HTTP 503"
    finally:
        assert post(plain, "/resume_memory_occupation", {}).status_code == 200
    assert client.liveness_problem(generate=True) is None


def test_freeze_gc_reaches_the_engine(plain):
    r = post(plain, "/freeze_gc")
    assert r.status_code == 200 and r.text == "Garbage collection frozen.\n"
    assert generate(plain, {"text": "hi", "sampling_params": greedy(2)})["meta_info"]["completion_tokens"] == 2


def test_sglangs_post_warmup_freeze_gc_reaches_a_server_started_without_warmup(spec):
    """SGLang posts its own /freeze_gc once warm; with --skip-server-warmup (slime always passes it) that post ran
    before uvicorn listened and was refused, leaving the front end's collector unfrozen."""
    poll(lambda: '"POST /freeze_gc HTTP/1.1" 200' in spec.log_path.read_text())
    assert "post-warmup freeze_gc failed" not in spec.log_path.read_text()


def test_the_engine_thread_blocks_while_released(tmp_path):
    """The scheduler's engine loop refuses a generate while memory is released and makes no pass while idle."""
    from slime_spec.engine.managers.request import Request, SamplingParams
    from slime_spec.engine.managers.scheduler import EngineLoop, Unavailable
    from slime_spec.engine.managers.scheduler_process import make_core_factory
    from slime_spec.engine.server_args import parse_server_args
    model = make_tiny_model(tmp_path / "llama", arch="llama", hidden_size=32, num_layers=1, seed=1)
    loop = EngineLoop(make_core_factory(parse_server_args(["--model-path", str(model), "--random-seed", "0"])))
    loop.start()
    try:
        loop.call(lambda core: core.release_memory(None)).result(timeout=60)
        with pytest.raises(Unavailable, match="resume_memory_occupation"):
            loop.generate(Request("r", [5, 6], SamplingParams(max_new_tokens=2))).result(timeout=60)
        before = loop.iterations
        time.sleep(0.3)  # an idle loop makes no pass at all (it used to spin while a request waited)
        assert loop.iterations == before
        loop.call(lambda core: core.resume_memory(None)).result(timeout=60)
        out = loop.generate(Request("s", [5, 6], SamplingParams(max_new_tokens=2, ignore_eos=True))).result(60)
        assert out.completion_tokens == 2
    finally:
        loop.stop()


def expected_device() -> str:
    """The server's --device default, as SGLang's: cuda where a GPU is visible, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def test_external_corpus_routes_and_history_extension(plain, tmp_path_factory):
    """SGLang 0.5.23's corpus routes on an NGRAM server; the `slime_history` extension drafts from one corpus."""
    assert post(plain, "/list_external_corpora").status_code == 405  # SGLang's route is GET only
    off = requests.get(plain.url + "/list_external_corpora", headers=AUTH, timeout=10)
    assert off.status_code == 400 and off.json()["message"] == "Ngram speculative decoding is not enabled."
    root = tmp_path_factory.mktemp("ngram_server")
    model = make_tiny_model(root / "llama", hidden_size=32, num_layers=2, seed=5)
    server = embedded_server_process(model, ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                                             "5", "--random-seed", "0"], log_path=root / "ngram.log").launch()
    try:
        server.wait_ready(300)
        bare = post(server, "/add_external_corpus", {"corpus_id": "x", "token_chunks": [[1, 2, 3]]}, headers={})
        assert bare.status_code == 400 and bare.json()["message"] == "Either file_path or documents must be provided."
        assert post(server, "/add_external_corpus", {"corpus_id": "x", "bogus": 1}, headers={}).status_code == 400
        prompt = [5, 9, 13, 2]
        first = generate(server, {"input_ids": prompt, "sampling_params": greedy(30)}, headers={})
        text = first["text"]
        added = post(server, "/add_external_corpus", {"corpus_id": "h", "documents": ["", text, "other doc"]},
                     headers={}).json()
        assert added["success"] and added["corpus_id"] == "h" and added["loaded_token_count"] > 0
        assert added["message"] == f"Loaded corpus 'h' with {added['loaded_token_count']} tokens."
        dup = post(server, "/add_external_corpus", {"corpus_id": "h", "documents": ["a"]}, headers={})
        assert dup.status_code == 400 and "already exists" in dup.json()["message"]
        listed = requests.get(server.url + "/list_external_corpora", timeout=10).json()
        assert listed == {"success": True, "corpus_token_counts": {"h": added["loaded_token_count"]}, "message": ""}
        again = generate(server, {"input_ids": prompt, "sampling_params": greedy(30),
                                  "slime_history": {"group": "g", "corpus_id": "h"}}, headers={})
        assert again["output_ids"] == first["output_ids"]  # lossless
        assert again["meta_info"]["spec_verify_ct"] < first["meta_info"]["spec_verify_ct"]
        bad = post(server, "/generate", {"input_ids": prompt, "slime_history": {"group": 3}}, headers={})
        assert bad.status_code == 400 and "slime_history.group" in bad.text
        gone = post(server, "/remove_external_corpus", {"corpus_id": "h"}, headers={}).json()
        assert gone == {"success": True, "message": "Removed corpus 'h'."}
        assert post(server, "/remove_external_corpus", {}, headers={}).status_code == 400  # SGLang: a required field
    finally:
        server.stop()


def test_history_extension_travels_in_extra_key():
    """The middleware's rewrite (pure): `slime_history` out of the body SGLang parses, into `extra_key`."""
    import json

    from slime_spec.engine.entrypoints.http_server import rewrite_generate_body
    from slime_spec.engine.managers.io_struct import history_extra_key
    raw = json.dumps({"input_ids": [1, 2], "slime_history": {"group": "g", "corpus_id": "h"}}).encode()
    body, error = rewrite_generate_body(raw)
    sent = json.loads(body)
    assert error is None and "slime_history" not in sent
    assert sent["extra_key"] == history_extra_key({"group": "g", "corpus_id": "h"})
    plain = b'{"text": "a", "extra_key": "salt"}'
    assert rewrite_generate_body(plain) == (plain, None)  # untouched, byte for byte
    for bad, needle in (({"text": ["a", "b"], "slime_history": {"group": "g"}}, "one prompt"),
                        ({"text": "a", "extra_key": "salt", "slime_history": {"group": "g"}}, "extra_key"),
                        ({"text": "a", "slime_history": {"group": 3}}, "slime_history.group")):
        _, (status, payload) = rewrite_generate_body(json.dumps(bad).encode())
        assert status == 400 and needle in json.loads(payload)["error"]["message"]
