"""The one HTTP client for an engine server (SGLang or the embedded engine): sync and async.

Every request carries the API key SGLang expects for its route (`Authorization: Bearer KEY`, from
`--sglang-api-key` / `--sglang-admin-api-key`), every failure is one `EngineError` (url, path, status,
body; status None when the engine could not be reached or went silent), and a JSON answer with
`"success": false` raises too, so a failed weight update never passes silently.

Timeouts bound silence, not duration: a read timeout (requests' read timeout, aiohttp's `sock_read`)
fires only when the engine sends nothing for that long, so a long generation is never cut at a fixed
total. SGLang answers a non-streaming /generate only when it is done, so for /generate the read
timeout is the longest one request may compute: keep it above the longest expected generation.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import aiohttp
import requests

from slime_spec.common.errors import StructuredError

CONNECT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 600.0  # control routes: a weight-update request can block on a collective this long
# SGLang's /health_generate waits this long for its one token (entrypoints/http_server.py HEALTH_CHECK_TIMEOUT).
HEALTH_CHECK_TIMEOUT_ENV, HEALTH_CHECK_TIMEOUT_DEFAULT_S = "SGLANG_HEALTH_CHECK_TIMEOUT", 20.0
PROBE_MARGIN_S = 10.0  # on top of it: the answer's own way back on a loaded machine
# A liveness probe that generates: the request SGLang's /health_generate sends its scheduler (one greedy token of
# input [0], kept out of the request metrics), through /generate.
GENERATION_PROBE = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                    "log_metrics": False}
# Routes SGLang 0.5.23 marks @auth_level(AuthLevel.ADMIN_OPTIONAL) (entrypoints/http_server.py), plus the
# embedded engine's /abort_weight_update: they take the admin key when one is configured.
ADMIN_ROUTES = frozenset({
    "/flush_cache", "/abort_request", "/pause_generation", "/continue_generation", "/release_memory_occupation",
    "/resume_memory_occupation", "/update_weight_version", "/begin_weight_update", "/end_weight_update",
    "/abort_weight_update", "/update_weights_from_disk", "/update_weights_from_tensor",
    "/update_weights_from_distributed", "/update_weights_from_ipc", "/init_weights_update_group",
    "/destroy_weights_update_group", "/get_weights_by_name", "/weights_checker", "/set_internal_state",
    "/start_profile", "/stop_profile", "/freeze_gc", "/slow_down", "/configure_logging",
    "/load_lora_adapter", "/unload_lora_adapter",
})
OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # SGLang never asks a key for probes


def health_check_timeout_s(env=os.environ) -> float:
    """SGLANG_HEALTH_CHECK_TIMEOUT as SGLang reads it (the engines inherit the same environment)."""
    raw = env.get(HEALTH_CHECK_TIMEOUT_ENV)
    try:
        value = float(raw) if raw not in (None, "") else HEALTH_CHECK_TIMEOUT_DEFAULT_S
    except ValueError:
        raise ValueError(f"{HEALTH_CHECK_TIMEOUT_ENV}={raw!r}: expected a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{HEALTH_CHECK_TIMEOUT_ENV}={raw!r}: must be > 0 seconds")
    return value


def probe_timeout_s(env=os.environ) -> float:
    """The bound on one liveness probe: SGLang's health-check timeout (how long /health_generate waits for its one
    token) and a margin. A probe silent for longer means the engine hangs."""
    return health_check_timeout_s(env) + PROBE_MARGIN_S


class EngineError(StructuredError):
    """An engine request failed: HTTP status and body as answered, or status None when unreachable."""

    def __init__(self, url: str, path: str, status: int | None, body: str):
        self.url, self.path, self.status, self.body = url, path, status, body
        what = f"answered HTTP {status}" if status is not None else "could not be reached"
        hint = ""
        if status in (401, 403):
            hint = (" (the engine wants an API key: pass the server's key as --sglang-api-key, and "
                    "--sglang-admin-api-key for admin routes when the server has one)")
        super().__init__(f"{url}{path} {what}: {body[:2000]}{hint}")

    @property
    def unreachable(self) -> bool:
        """No HTTP answer: connection refused or reset, or silence past the read timeout."""
        return self.status is None


@dataclass(frozen=True)
class EngineAuth:
    api_key: str | None = None
    admin_api_key: str | None = None

    @classmethod
    def from_server_args(cls, server_args: dict) -> "EngineAuth":
        """From the forwarded SGLang flags (`--sglang-api-key`, `--sglang-admin-api-key`)."""
        return cls(server_args.get("api_key"), server_args.get("admin_api_key"))

    def headers(self, path: str) -> dict[str, str]:
        """The Authorization header SGLang checks on `path` (none for health probes)."""
        path = path.split("?", 1)[0]
        if path.startswith(OPEN_PREFIXES):
            return {}
        key = (self.admin_api_key or self.api_key) if path in ADMIN_ROUTES else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


def parse_response(url: str, path: str, status: int, body: str) -> dict:
    """A JSON object as is, a JSON list as {"result": list}, text as {"text": body}, nothing as {}."""
    if not 200 <= status < 300:
        raise EngineError(url, path, status, body)
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return {"text": body}
    if isinstance(data, dict) and data.get("success") is False:
        raise EngineError(url, path, status, body)
    return data if isinstance(data, dict) else {"result": data}


class EngineClient:
    """Blocking client (control routes, weight sync, canary); one keep-alive session."""

    def __init__(self, url: str, auth: EngineAuth = EngineAuth(), *, read_timeout_s: float | None = READ_TIMEOUT_S):
        self.url, self.auth, self.read_timeout_s = url.rstrip("/"), auth, read_timeout_s
        self._session = requests.Session()
        self._server_info_path = "/server_info"

    def post(self, path: str, payload: dict | None = None, read_timeout_s: float | None = None) -> dict:
        return self.request("POST", path, {} if payload is None else payload, read_timeout_s)

    def get(self, path: str, read_timeout_s: float | None = None) -> dict:
        return self.request("GET", path, None, read_timeout_s)

    def request(self, method: str, path: str, payload: dict | None = None,
                read_timeout_s: float | None = None) -> dict:
        timeout = (CONNECT_TIMEOUT_S, read_timeout_s or self.read_timeout_s)
        try:
            r = self._session.request(method, self.url + path, json=payload, headers=self.auth.headers(path),
                                      timeout=timeout)
        except requests.RequestException as e:
            raise EngineError(self.url, path, None, f"{type(e).__name__}: {e}") from e
        return parse_response(self.url, path, r.status_code, r.text)

    def status(self, method: str, path: str) -> int:
        """The HTTP status alone (a route probe: 404 missing, 405 present but POST-only)."""
        try:
            return self._session.request(method, self.url + path, headers=self.auth.headers(path),
                                         timeout=(CONNECT_TIMEOUT_S, self.read_timeout_s)).status_code
        except requests.RequestException as e:
            raise EngineError(self.url, path, None, f"{type(e).__name__}: {e}") from e

    def server_info(self) -> dict:
        """GET /server_info; /get_server_info (deprecated in 0.5.23) only for servers without it (404)."""
        try:
            return self.get(self._server_info_path)
        except EngineError as e:
            if e.status != 404 or self._server_info_path == "/get_server_info":
                raise
            self._server_info_path = "/get_server_info"
            return self.get(self._server_info_path)

    def healthy(self, timeout_s: float | None = None) -> bool:
        """Liveness as SGLang's /ping reports it (see `liveness_problem`)."""
        return self.liveness_problem(generate=False, timeout_s=timeout_s) is None

    def liveness_problem(self, generate: bool = False, timeout_s: float | None = None) -> str | None:
        """None when the engine answers as a live one; else why not, within a bounded time.

        generate=False: SGLang's /ping (200 while generation is paused for a weight sync or memory is released),
        the check during a rollout or a sync; its 503 means SGLang marked the server unhealthy (a failed health
        check). /ping reads a flag only: a scheduler blocked in a collective still answers 200, so a sync names
        such engines itself (WeightSyncError.stuck_urls). generate=True: one token generated through /generate,
        the request SGLang's /health_generate makes (GENERATION_PROBE), answered as soon as the token is out:
        /health_generate itself polls once a second, so it never answers in under 1 s, and the loop probes before
        every rollout, eval and sync. Only for an engine that should be serving (a paused one holds the request).
        Silence past `timeout_s` (default `probe_timeout_s()`) is a hang, as a stopped process gives.
        Servers without /ping (404: older SGLang) fall back to /health.
        """
        timeout_s = probe_timeout_s() if timeout_s is None else timeout_s
        timeout = (min(CONNECT_TIMEOUT_S, timeout_s), timeout_s)
        probes = [("POST", "/generate", GENERATION_PROBE)] if generate else [("GET", "/ping", None),
                                                                             ("GET", "/health", None)]
        for method, path, payload in probes:
            try:
                r = self._session.request(method, self.url + path, json=payload, headers=self.auth.headers(path),
                                          timeout=timeout)
            except requests.Timeout:
                return f"{path} did not answer within {timeout_s:g} s (hung)"
            except requests.RequestException as e:
                return f"{path} could not be reached ({type(e).__name__})"
            if r.status_code != 404:
                return None if r.status_code == 200 else f"{path} answered HTTP {r.status_code}"
        return f"{path} answered HTTP 404"

    def close(self) -> None:
        self._session.close()


def weight_version_of(client: EngineClient) -> str | None:
    """`weight_version` as SGLang reports it (`/model_info`; `/get_model_info` on servers without it)."""
    for path in ("/model_info", "/get_model_info"):
        try:
            return client.get(path).get("weight_version")
        except EngineError as e:
            if e.status != 404:
                raise
    return None


def async_session(read_timeout_s: float | None) -> aiohttp.ClientSession:
    """A session for many concurrent requests: no total timeout, only connect and idle-read bounds."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=read_timeout_s))


@dataclass
class AsyncEngineClient:
    """Non-blocking client over a shared aiohttp session (the rollout's /generate hot path)."""

    url: str
    session: aiohttp.ClientSession
    auth: EngineAuth = EngineAuth()

    async def post(self, path: str, payload: dict | None = None) -> dict:
        return await self.request("POST", path, {} if payload is None else payload)

    async def get(self, path: str) -> dict:
        return await self.request("GET", path, None)

    async def generate(self, payload: dict) -> dict:
        return await self.post("/generate", payload)

    async def generate_batch(self, payload: dict) -> list:
        """A batched /generate (lists of inputs): SGLang answers with one output per input, in order."""
        answer = await self.post("/generate", payload)
        if set(answer) != {"result"} or not isinstance(answer["result"], list):
            raise ValueError(f"{self.url}/generate answered a batched request with {str(answer)[:200]}: SGLang "
                             "answers one with a list of outputs")
        return answer["result"]

    async def request(self, method: str, path: str, payload: dict | None) -> dict:
        try:
            async with self.session.request(method, f"{self.url}{path}", json=payload,
                                            headers=self.auth.headers(path)) as r:
                return parse_response(self.url, path, r.status, await r.text())
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as e:
            raise EngineError(self.url, path, None, f"{type(e).__name__}: {e}") from e

    async def add_external_corpus(self, corpus_id: str, documents: list[str]) -> dict:
        """NGRAM drafting corpus (SGLang 0.5.23): a 400 (e.g. the id exists, over budget) raises EngineError."""
        return await self.post("/add_external_corpus", add_corpus_payload(corpus_id, documents))

    async def remove_external_corpus(self, corpus_id: str) -> dict:
        return await self.post("/remove_external_corpus", remove_corpus_payload(corpus_id))

    async def list_external_corpora(self) -> dict[str, int]:
        return (await self.get("/list_external_corpora"))["corpus_token_counts"]

    async def server_info(self) -> dict:
        try:
            return await self.get("/server_info")
        except EngineError as e:
            if e.status != 404:
                raise
            return await self.get("/get_server_info")


def add_corpus_payload(corpus_id: str, documents: list[str]) -> dict:
    """SGLang's AddExternalCorpusReqInput: `documents`, since its HTTP route refuses bare `token_chunks`."""
    return {"corpus_id": corpus_id, "documents": list(documents)}


def remove_corpus_payload(corpus_id: str) -> dict:
    return {"corpus_id": corpus_id}


class EngineGroupError(StructuredError):
    """Some engines failed a request that others completed: says which, so the caller can report state."""

    def __init__(self, path: str, failures: dict[str, BaseException], succeeded: list[str]):
        self.path, self.failures, self.succeeded = path, failures, succeeded
        lines = "; ".join(f"{url}: {e}" for url, e in failures.items())
        ok = f" (succeeded on {', '.join(succeeded)})" if succeeded else ""
        super().__init__(f"{path} failed on {len(failures)} engine(s){ok}: {lines}")


def post_all(clients: Sequence[EngineClient], path: str, payload: dict | Callable[[int], dict]) -> list[dict]:
    """POST to every engine at once (engines block until a group forms or a broadcast completes).

    Waits for every engine, then raises EngineGroupError naming each engine that failed.
    """
    def call(i: int, c: EngineClient) -> dict:
        return c.post(path, payload(i) if callable(payload) else payload)

    if len(clients) == 1:
        try:
            return [call(0, clients[0])]
        except Exception as e:
            raise EngineGroupError(path, {clients[0].url: e}, []) from e
    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        futures = [pool.submit(call, i, c) for i, c in enumerate(clients)]
        errors = {c.url: f.exception() for c, f in zip(clients, futures)}
    failures = {url: e for url, e in errors.items() if e is not None}
    if failures:
        raise EngineGroupError(path, failures, [url for url, e in errors.items() if e is None]) \
            from next(iter(failures.values()))
    return [f.result() for f in futures]

