"""fleet/client.py: answers and errors, the API key on every route, idle (not total) timeouts, /server_info."""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from slime_spec.fleet.client import (
    AsyncEngineClient,
    EngineAuth,
    EngineClient,
    EngineError,
    async_session,
    parse_response,
)


def test_parse_response():
    assert parse_response("u", "/p", 200, "") == {}
    assert parse_response("u", "/p", 200, "Cache flushed.\n") == {"text": "Cache flushed.\n"}
    assert parse_response("u", "/p", 200, '{"success": true, "message": "ok"}') == {"success": True, "message": "ok"}
    with pytest.raises(EngineError, match="HTTP 400") as e:
        parse_response("u", "/p", 400, '{"error": {"message": "bad"}}')
    assert (e.value.url, e.value.path, e.value.status, e.value.body) == \
        ("u", "/p", 400, '{"error": {"message": "bad"}}')
    with pytest.raises(EngineError, match="must run between"):  # a 200 that says it failed is a failure
        parse_response("u", "/p", 200, '{"success": false, "message": "must run between begin and end"}')


def test_auth_headers_follow_sglang_route_levels():
    both = EngineAuth(api_key="K", admin_api_key="A")
    assert both.headers("/generate") == {"Authorization": "Bearer K"}
    assert both.headers("/update_weights_from_distributed") == {"Authorization": "Bearer A"}
    assert both.headers("/health") == {} and both.headers("/health_generate") == {}
    only_key = EngineAuth(api_key="K")
    assert only_key.headers("/weights_checker") == {"Authorization": "Bearer K"}
    assert EngineAuth().headers("/generate") == {}
    assert EngineAuth.from_server_args({"api_key": "K", "admin_api_key": None}) == only_key


@pytest.fixture(scope="module")
def keyed_engine(tmp_path_factory):
    from slime_spec.fleet.process import embedded_server_process
    from slime_spec.tools.tiny_model import make_tiny_model
    root = tmp_path_factory.mktemp("keyed_engine")
    model = make_tiny_model(root / "llama", arch="llama", hidden_size=32, num_layers=1, seed=0)
    with embedded_server_process(model, ["--api-key", "K", "--admin-api-key", "A"],
                                 log_path=root / "server.log").start(300) as server:
        yield server


def test_api_key_is_sent_on_every_route(keyed_engine):
    url = keyed_engine.url
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    assert requests.post(f"{url}/generate", json=body, timeout=60).status_code == 401
    assert requests.post(f"{url}/generate", json=body, headers={"Authorization": "Bearer K"},
                         timeout=60).status_code == 200
    assert requests.get(f"{url}/health", timeout=60).status_code == 200  # probes need no key
    client = EngineClient(url, EngineAuth(api_key="K", admin_api_key="A"))
    assert len(client.post("/generate", body)["output_ids"]) == 2
    client.post("/flush_cache")  # an admin route: the admin key
    assert "weight_version" in client.server_info()
    with pytest.raises(EngineError, match="--sglang-admin-api-key") as e:
        EngineClient(url, EngineAuth(api_key="K")).post("/flush_cache")
    assert e.value.status == 401

    async def generate_async():
        async with async_session(60) as session:
            return await AsyncEngineClient(url, session, EngineAuth(api_key="K")).generate(body)
    assert len(asyncio.run(generate_async())["output_ids"]) == 2


class _Handler(BaseHTTPRequestHandler):
    """/trickle: a byte every 0.3 s for 2 s; /stall: 2 s of silence; /get_server_info only (an old server)."""

    calls: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        type(self).calls.append(self.path)
        if self.path == "/trickle":
            self.send_response(200)
            self.send_header("Content-Length", "7")
            self.end_headers()
            for ch in b"{}     ":
                self.wfile.write(bytes([ch]))
                self.wfile.flush()
                time.sleep(0.3)
        elif self.path == "/stall":
            time.sleep(2.0)
            self._json(200, b"{}")
        elif self.path == "/get_server_info":
            self._json(200, b'{"version": "0.4.10", "weight_version": "default"}')
        else:
            self._json(404, b'{"detail": "Not Found"}')

    def _json(self, status, body):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def slow_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_timeout_bounds_silence_not_duration(slow_server):
    client = EngineClient(slow_server, read_timeout_s=1.0)
    t0 = time.monotonic()
    assert client.get("/trickle") == {}  # 2 s in all, never 1 s silent: a long generation is not cut
    assert time.monotonic() - t0 > 1.5
    with pytest.raises(EngineError, match="could not be reached") as e:
        client.get("/stall")
    assert e.value.unreachable

    async def both():
        async with async_session(1.0) as session:
            c = AsyncEngineClient(slow_server, session)
            assert await c.get("/trickle") == {}
            with pytest.raises(EngineError) as err:
                await c.get("/stall")
            assert err.value.unreachable
    asyncio.run(both())


def test_server_info_falls_back_only_for_old_servers(slow_server):
    _Handler.calls.clear()
    assert EngineClient(slow_server).server_info()["version"] == "0.4.10"
    assert _Handler.calls == ["/server_info", "/get_server_info"]

    async def fetch():
        async with async_session(10) as session:
            return await AsyncEngineClient(slow_server, session).server_info()
    assert asyncio.run(fetch())["weight_version"] == "default"


class _Probed(BaseHTTPRequestHandler):
    """An engine's probes as a test double of SGLang's: /ping 200 (or 503 once marked unhealthy), /generate 503
    (memory released), or a server too old for /ping (404, then /health). Records each probe's path and body."""

    answers: dict = {}
    seen: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        type(self).seen.append((self.path, None))
        self._answer()

    def do_POST(self):
        type(self).seen.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
        self._answer()

    def _answer(self):
        status = type(self).answers.get(self.path, 404)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def probed():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Probed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_liveness_follows_sglang_ping_and_a_generated_token(probed):
    from slime_spec.fleet.client import GENERATION_PROBE
    client = EngineClient(probed)
    _Probed.answers = {"/ping": 200, "/generate": 503}  # memory released: alive, not generating
    assert client.liveness_problem(generate=False) is None and client.healthy()
    _Probed.seen = []
    assert client.liveness_problem(generate=True) == "/generate answered HTTP 503"
    assert _Probed.seen == [("/generate", GENERATION_PROBE)]  # one greedy token, nothing else asked
    _Probed.answers = {"/health": 200, "/generate": 200}  # an older server: no /ping
    assert client.liveness_problem(generate=False) is None and client.liveness_problem(generate=True) is None
    _Probed.answers = {"/ping": 503}  # SGLang marks a server unhealthy after a failed /health_generate
    assert client.liveness_problem() == "/ping answered HTTP 503"


def test_a_hung_engine_is_found_within_the_bound():
    """A stopped process: the kernel accepts the connection, nothing ever answers."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        problem = EngineClient(url).liveness_problem(generate=True, timeout_s=0.5)
    assert problem == "/generate did not answer within 0.5 s (hung)"
    assert "could not be reached" in EngineClient(url).liveness_problem(timeout_s=0.5)  # the port is closed now


def test_probe_bounds_follow_sglang_health_check_timeout():
    from slime_spec.fleet.client import PROBE_MARGIN_S, probe_timeout_s
    assert probe_timeout_s({}) == 20 + PROBE_MARGIN_S  # SGLang's default SGLANG_HEALTH_CHECK_TIMEOUT
    assert probe_timeout_s({"SGLANG_HEALTH_CHECK_TIMEOUT": "3"}) == 3 + PROBE_MARGIN_S
    with pytest.raises(ValueError, match="SGLANG_HEALTH_CHECK_TIMEOUT"):
        probe_timeout_s({"SGLANG_HEALTH_CHECK_TIMEOUT": "soon"})
