"""The one thing weight sync needs from an engine: its URL and a JSON POST.

`EngineClient` is a Protocol so the same sync code drives a plain HTTP client (tests, the
benchmark, a trainer that only knows URLs) and the rollout's EngineActor (which has `url` and
`post`). Every failure is an `EngineRequestError` carrying the route, HTTP status and the
server's message, so a failed sync names the engine and the step that failed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import requests

class EngineRequestError(RuntimeError):
    def __init__(self, url: str, path: str, status: int | None, message: str):
        self.url, self.path, self.status, self.message = url, path, status, message
        where = f"{url}{path}"
        super().__init__(f"{where} failed (HTTP {status}): {message}" if status is not None
                         else f"{where} failed: {message}")


@runtime_checkable
class EngineClient(Protocol):
    url: str

    def post(self, path: str, payload: dict) -> dict:
        """POST JSON, return the JSON reply; raise EngineRequestError on an HTTP or `success: false` error."""
        ...


class HttpEngineClient:
    """A direct HTTP client for one engine (SGLang or the embedded server)."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._session = requests.Session()

    def post(self, path: str, payload: dict) -> dict:
        return self._request("POST", path, payload)

    def get(self, path: str) -> dict:
        return self._request("GET", path, None)

    def _request(self, method: str, path: str, payload: dict | None) -> dict:
        try:
            r = self._session.request(method, self.url + path, json=payload, timeout=self.timeout_s)
        except requests.RequestException as e:
            raise EngineRequestError(self.url, path, None, f"{type(e).__name__}: {e}") from e
        body = _json_or_text(r)
        if r.status_code >= 400:
            raise EngineRequestError(self.url, path, r.status_code, _error_message(body))
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineRequestError(self.url, path, r.status_code, str(body.get("message")))
        return body if isinstance(body, dict) else {"result": body}

    def close(self) -> None:
        self._session.close()


def _error_message(body: Any) -> str:
    """SGLang answers errors as {"success": false, "message"}, {"error": {"message"}} or {"detail"}."""
    if not isinstance(body, dict):
        return str(body)
    error = body.get("error")
    if isinstance(error, dict):
        error = error.get("message")
    return str(body.get("message") or error or body.get("detail") or body.get("text") or body)


def _json_or_text(r: requests.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return {"text": r.text}


def check_success(client: EngineClient, path: str, reply: dict) -> dict:
    """Raise if a reply that reached us says `success: false` (EngineActor may not raise itself)."""
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineRequestError(client.url, path, None, str(reply.get("message")))
    return reply


class EngineGroupError(RuntimeError):
    """Some engines failed a request that others completed: says which, so the caller can report state."""

    def __init__(self, path: str, failures: dict[str, BaseException], succeeded: list[str]):
        self.path, self.failures, self.succeeded = path, failures, succeeded
        lines = "; ".join(f"{url}: {e}" for url, e in failures.items())
        ok = f" (succeeded on {', '.join(succeeded)})" if succeeded else ""
        super().__init__(f"{path} failed on {len(failures)} engine(s){ok}: {lines}")


def post_all(clients: Sequence[EngineClient], path: str, payload: dict | Callable[[int], dict]) -> list[dict]:
    """POST to every engine at once (the engines block until the group or the broadcast completes).

    Waits for every engine, then raises EngineGroupError naming each engine that failed.
    """
    def call(i: int, c: EngineClient) -> dict:
        return check_success(c, path, c.post(path, payload(i) if callable(payload) else payload))

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
