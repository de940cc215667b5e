"""The embedded server over real HTTP: SGLang's /generate contract, control routes, errors, auth.

Two servers on one tiny MiMo checkpoint, started once for the module: `plain` (no speculation,
an API key) and `spec` (EAGLE with the checkpoint's MTP layer).
"""

import threading
import time

import pytest
import requests

from slime_spec.engines.process import embedded_server_process
from slime_spec.tiny_model import make_tiny_model

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["hello world", "the cat sat on", "abc abc abc", "0123", "zz", "Once upon a time", "q", "RL is fun"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_server")
    model = make_tiny_model(root / "mimo", arch="mimo", hidden_size=32, num_layers=2, seed=3)
    plain = embedded_server_process(model, ["--api-key", KEY, "--random-seed", "0", "--max-running-requests", "8"],
                                    log_path=root / "plain.log").launch()
    spec = embedded_server_process(model, ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                                 "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
                                 "--random-seed", "0", "--mem-fraction-static", "0.7"],
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
        assert m["spec_num_proposed_drafts"] == m["spec_draft_token_num"] == 3 * m["spec_verify_ct"]
        assert 0 <= m["spec_num_correct_drafts"] == m["spec_accept_token_num"] <= m["spec_num_proposed_drafts"]
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


BAD_BODIES = [
    ({}, "Either text, input_ids"),
    ({"text": "a", "input_ids": [1, 2]}, "cannot be provided at the same time"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature must be"),
    ({"text": "a", "sampling_params": {"top_p": 2.0}}, "top_p must be in (0, 1]"),
    ({"text": "a", "sampling_params": {"not_a_param": 1}}, "not_a_param"),
    ({"text": "a", "sampling_params": {"repetition_penalty": 1.5}}, "repetition_penalty"),
    ({"text": "a", "stream": True}, "stream"),
    ({"input_ids": [1, 100000]}, "out-of-vocabulary"),
    ({"input_ids": [5] * 1030}, "longer than the model's context length"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 5000}}, "exceeds the model's maximum context length"),
    ({"text": ["a", "b"], "rid": ["only-one"]}, "rids length mismatch"),
    ({"text": "a", "no_such_field": 1}, "no_such_field"),
    ({"text": "a", "top_logprobs_num": 3, "return_logprob": True}, "top_logprobs_num"),
    ({"text": 5}, ""),
]


def test_bad_requests_get_400_and_the_server_keeps_serving(plain):
    for body, needle in BAD_BODIES:
        r = post(plain, "/generate", body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        message = error["message"] if isinstance(error, dict) else error
        assert needle in message, (body, message)
    r = requests.post(plain.url + "/generate", data=b"{not json", headers=AUTH, timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = post(plain, "/update_weights_from_distributed", {"names": ["x"]})
    assert r.status_code == 400 and "missing required field" in r.json()["error"]["message"]
    r = post(plain, "/pause_generation", {"mode": "sideways"})
    assert r.status_code == 400 and "sideways" in r.json()["error"]["message"]
    assert requests.get(plain.url + "/health_generate", timeout=30).status_code == 200
    assert generate(plain, {"text": "still alive", "sampling_params": greedy(3)})["meta_info"]["completion_tokens"] == 3


def test_info_endpoints(plain):
    assert requests.get(plain.url + "/health", timeout=10).status_code == 200
    assert requests.get(plain.url + "/health_generate", timeout=30).status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = requests.get(plain.url + path, headers=AUTH, timeout=10).json()
        assert info["model_type"] == "mimo" and info["architectures"] == ["MiMoForCausalLM"]
        assert info["is_generation"] is True and info["weight_version"] == "default"
    for path in ("/get_server_info", "/server_info"):
        info = requests.get(plain.url + path, headers=AUTH, timeout=10).json()
        assert info["version"] == "0.5.23" and info["tp_size"] == 1 and info["device"] == expected_device()
        assert "api_key" not in info and "last_gen_throughput" in info["internal_states"][0]


def test_api_key(plain):
    r = requests.post(plain.url + "/generate", json={"text": "a"}, timeout=10)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    r = requests.post(plain.url + "/flush_cache", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    assert requests.get(plain.url + "/health", timeout=10).status_code == 200
    assert post(plain, "/flush_cache").status_code == 200


def _in_thread(fn):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()))
    thread.start()
    return thread, result


def test_pause_in_place_holds_requests_and_abort_by_rid(plain):
    assert post(plain, "/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
    waiting, res_w = _in_thread(lambda: generate(plain, {"text": "wait", "sampling_params": greedy(5), "rid": "w"}))
    aborted, res_a = _in_thread(lambda: generate(plain, {"text": "go", "sampling_params": greedy(5), "rid": "x"}))
    poll(lambda: load(plain)["num_waiting_reqs"] == 2)
    assert post(plain, "/abort_request", {"rid": "x"}).status_code == 200
    aborted.join(timeout=30)
    assert res_a["value"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert res_a["value"]["output_ids"] == []
    assert waiting.is_alive()
    assert post(plain, "/continue_generation", {}).json()["status"] == "ok"
    waiting.join(timeout=30)
    assert res_w["value"]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


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
    assert post(plain, "/pause_generation", {"mode": "in_place"}).status_code == 200
    thread, res = _in_thread(lambda: generate(plain, {"text": "busy", "sampling_params": greedy(1000)}))
    poll(lambda: load(plain)["num_waiting_reqs"] == 1)
    assert post(plain, "/continue_generation", {}).status_code == 200
    poll(lambda: load(plain)["num_running_reqs"] == 1)
    assert post(plain, "/pause_generation", {"mode": "in_place"}).status_code == 200
    r = post(plain, "/flush_cache")
    assert r.status_code == 400 and "pending requests" in r.text
    assert post(plain, "/continue_generation", {}).status_code == 200
    thread.join(timeout=60)
    assert res["value"]["meta_info"]["completion_tokens"] == 1000


def test_release_resume_memory_and_weight_version(spec):
    before = generate(spec, {"text": PROMPTS[:2], "sampling_params": greedy(8)}, headers={})
    assert post(spec, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]}, headers={}).status_code == 200
    assert post(spec, "/resume_memory_occupation", {}, headers={}).status_code == 200
    after = generate(spec, {"text": PROMPTS[:2], "sampling_params": greedy(8)}, headers={})
    assert [o["output_ids"] for o in after] == [o["output_ids"] for o in before]
    assert [o["meta_info"]["spec_num_correct_drafts"] for o in after] == \
        [o["meta_info"]["spec_num_correct_drafts"] for o in before]
    r = post(spec, "/release_memory_occupation", {"tags": ["gpu_magic"]}, headers={})
    assert r.status_code == 400 and "gpu_magic" in r.json()["error"]["message"]
    r = post(spec, "/update_weight_version", {"new_version": "v7"}, headers={})
    assert r.json() == {"success": True, "message": "Weight version updated to v7", "new_version": "v7"}
    meta = generate(spec, {"text": "a", "sampling_params": greedy(1)}, headers={})["meta_info"]
    assert meta["weight_version"] == "v7"


def test_performance_only_flags_are_logged_once(spec):
    log = spec.log_path.read_text()
    assert log.count("accepted and ignored") == 1 and "--mem-fraction-static=0.7" in log


def test_a_client_that_disconnects_aborts_its_request(plain):
    assert post(plain, "/pause_generation", {"mode": "in_place"}).status_code == 200
    with pytest.raises(requests.Timeout):
        requests.post(plain.url + "/generate", json={"text": "bye", "sampling_params": greedy(5)}, headers=AUTH,
                      timeout=1.5)
    poll(lambda: load(plain)["num_waiting_reqs"] == 0)  # still paused: only the disconnect can remove it
    assert post(plain, "/continue_generation", {}).status_code == 200


BAD_INPUTS = [  # (path, json body, status, what the message must name); every one is a 4xx, never a 500
    ("/generate", {"text": "a", "sampling_params": {"temperature": "hot"}}, 400, "sampling_params.temperature"),
    ("/generate", {"text": "a", "sampling_params": {"n": 0}}, 400, "sampling_params.n=0"),
    ("/generate", {"text": "a", "sampling_params": {"n": 20000}}, 400, "sampling_params.n=20000"),
    ("/generate", {"text": ["a"] * 600}, 400, "64 x --max-running-requests"),
    ("/generate", {"text": "ab" * 2_000_000}, 400, "text has 4000000 characters"),
    ("/generate", {"input_ids": [[1], 2]}, 400, "input_ids"),
    ("/update_weight_version", {"new_version": {"a": 1}}, 400, "new_version"),
    ("/update_weights_from_disk", {"model_path": 5}, 400, "model_path"),
    ("/release_memory_occupation", {"tags": "weights"}, 400, "tags"),
    ("/abort_request", {"rid": 5}, 400, "rid"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": "x", "rank_offset": 1, "world_size": 2},
     400, "master_port"),
    ("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": "x"}, 400, "truncate_size"),
]


def error_message(r) -> str:
    error = r.json()["error"]
    return error["message"] if isinstance(error, dict) else error


def test_bad_inputs_are_refused_naming_the_field(plain):
    for path, body, status, needle in BAD_INPUTS:
        r = post(plain, path, body)
        assert r.status_code == status and needle in error_message(r), (path, body, r.status_code, r.text)
    raw = b'{"text": "a", "sampling_params": {"stop": ' + b"[" * 5000 + b"]" * 5000 + b"}}"
    r = requests.post(plain.url + "/generate", data=raw, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "nests" in error_message(r)
    r = requests.post(plain.url + "/flush_cache?timeout=abc", headers=AUTH, timeout=10)
    assert r.status_code == 400 and "timeout" in error_message(r)
    r = requests.post(plain.url + "/generate", json={"text": "a"}, timeout=10,
                      headers={"Authorization": "Bearer k\u00e9y".encode()})
    assert r.status_code == 401 and "ASCII" in r.json()["error"]
    assert generate(plain, {"text": "still alive", "sampling_params": greedy(3)})["meta_info"]["completion_tokens"] == 3


def test_generate_while_memory_is_released_is_refused_not_held(plain):
    assert post(plain, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    try:
        r = post(plain, "/generate", {"text": "a", "sampling_params": greedy(2)})
        assert r.status_code == 503 and "/resume_memory_occupation" in error_message(r)
        for path in ("/health", "/health_generate", "/ready"):
            r = requests.get(plain.url + path, timeout=10)
            assert r.status_code == 503 and "memory is released" in error_message(r), path
        assert requests.get(plain.url + "/ping", headers=AUTH, timeout=10).status_code == 200  # alive
    finally:
        assert post(plain, "/resume_memory_occupation", {}).status_code == 200
    assert requests.get(plain.url + "/health", timeout=30).status_code == 200
    assert generate(plain, {"text": "back", "sampling_params": greedy(2)})["meta_info"]["completion_tokens"] == 2


def test_health_says_why_while_paused(plain):
    assert post(plain, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        r = requests.get(plain.url + "/health", timeout=10)
        assert r.status_code == 503 and "/continue_generation" in error_message(r)
        assert requests.get(plain.url + "/ready", timeout=10).status_code == 503
        assert requests.get(plain.url + "/ping", headers=AUTH, timeout=10).status_code == 200
    finally:
        assert post(plain, "/continue_generation", {}).status_code == 200


class FakeClock:
    """The engine loop's time source, moved by hand: a stuck operation without waiting for it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def inproc(tmp_path_factory):
    """The app in this process (FastAPI TestClient), so a test can hold the tokenizer or the engine thread."""
    from fastapi.testclient import TestClient

    from slime_spec.engine.__main__ import make_core_factory
    from slime_spec.engine.http_server import create_app
    from slime_spec.engine.scheduler import EngineLoop
    from slime_spec.engine.server_args import parse_server_args
    from slime_spec.engine.weight_updater import WeightUpdater

    model = make_tiny_model(tmp_path_factory.mktemp("inproc") / "llama", arch="llama", hidden_size=32,
                            num_layers=1, seed=1)
    args = parse_server_args(["--model-path", str(model), "--max-running-requests", "4", "--random-seed", "0"])
    clock = FakeClock()
    loop = EngineLoop(make_core_factory(args), clock=clock)
    loop.start()
    app = create_app(args, loop, WeightUpdater(args.weight_version, args.model_path, args.device,
                                               args.has_draft_model))
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            client.loop, client.clock = loop, clock
            yield client
    finally:
        loop.stop()


def test_freeze_gc_moves_the_live_heap_out_of_the_collectors_passes(inproc):
    """SGLang's /freeze_gc (its server calls it once warm; our __main__ freezes at start-up the same way)."""
    import gc

    try:
        res = inproc.post("/freeze_gc")
        assert res.status_code == 200 and res.text == "Garbage collection frozen.\n"
        assert gc.get_freeze_count() > 1000  # the model, tokenizer and app of this process
        assert inproc.post("/generate", json={"text": "hi", "sampling_params": greedy(2)}).status_code == 200
    finally:
        gc.unfreeze()  # this test process keeps collecting as before


def test_health_answers_while_a_prompt_is_tokenized(inproc):
    tokenizer = inproc.loop.core.tokenizer
    entered, release = threading.Event(), threading.Event()

    class HeldTokenizer:  # test double: the real tokenizer, held inside encode("HOLD") until released
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode(self, text, *args, **kwargs):
            if text == "HOLD":
                entered.set()
                release.wait(60)
            return tokenizer.encode(text, *args, **kwargs)

    inproc.loop.core.tokenizer = HeldTokenizer()
    try:
        thread, res = _in_thread(lambda: inproc.post("/generate", json={"text": "HOLD", "sampling_params": greedy(2)}))
        assert entered.wait(60)
        assert inproc.get("/health").status_code == 200  # generated its own token meanwhile
        assert inproc.get("/ping").status_code == 200
        assert thread.is_alive()  # the /generate is still inside encode
        release.set()
        thread.join(timeout=60)
        assert res["value"].status_code == 200 and res["value"].json()["meta_info"]["completion_tokens"] == 2
    finally:
        release.set()
        inproc.loop.core.tokenizer = tokenizer


def test_health_names_a_stuck_weight_sync(inproc):
    entered, release = threading.Event(), threading.Event()

    def hung_sync(core):  # what a /update_weights_from_distributed whose trainer never broadcasts does
        entered.set()
        release.wait(60)

    done = inproc.loop.call(hung_sync, needs_idle=True, label="/update_weights_from_distributed")
    try:
        assert entered.wait(60)
        assert inproc.get("/ping").status_code == 200  # inside it, but not yet for longer than the timeout
        inproc.clock.now += 21.0  # past SGLANG_HEALTH_CHECK_TIMEOUT (20 s)
        for path in ("/health", "/health_generate", "/ping", "/ready"):
            r = inproc.get(path)
            assert r.status_code == 503 and "inside /update_weights_from_distributed" in error_message(r), path
    finally:
        release.set()
    done.result(timeout=60)
    assert inproc.get("/health").status_code == 200


def test_the_engine_thread_blocks_while_released(inproc):
    assert inproc.post("/release_memory_occupation", json={}).status_code == 200
    try:
        r = inproc.post("/generate", json={"text": "a", "sampling_params": greedy(2)})
        assert r.status_code == 503
        before = inproc.loop.iterations
        time.sleep(0.3)  # an idle loop makes no pass at all (it used to spin while a request waited)
        assert inproc.loop.iterations == before
    finally:
        assert inproc.post("/resume_memory_occupation", json={}).status_code == 200


def test_an_oversized_body_is_413_before_it_is_parsed(inproc):
    from slime_spec.engine.http_server import MAX_REQUEST_BODY_BYTES

    raw = b'{"text": "' + b"x" * (MAX_REQUEST_BODY_BYTES + 1) + b'"}'
    r = inproc.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "32 MiB" in error_message(r)
    r = inproc.post("/update_weight_version", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 413


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
        assert post(server, "/remove_external_corpus", {}, headers={}).json()["message"] == "corpus_id is required."
    finally:
        server.stop()
