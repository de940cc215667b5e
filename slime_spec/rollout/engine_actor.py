"""`Engine`: one engine server process plus a thin HTTP client; `EngineActor` is the same class as a Ray actor.

The rollout hot path (`/generate`) goes from the `RolloutManager` straight to `url` over aiohttp;
this class owns the process lifecycle and the control routes. Every route helper is a thin
`post(path, payload) -> dict` over SGLang's native HTTP API, so it works unchanged against
`sglang.launch_server` and the embedded engine:

| helper                                   | route                                    |
| ---------------------------------------- | ---------------------------------------- |
| `generate(payload)`                      | POST /generate                           |
| `get_server_info()`                      | GET  /get_server_info                    |
| `flush_cache()`                          | POST /flush_cache                        |
| `pause_generation(mode="abort")`         | POST /pause_generation                   |
| `continue_generation()`                  | POST /continue_generation                |
| `abort_request(rid=None)`                | POST /abort_request (all when rid None)  |
| `release_memory_occupation(tags=None)`   | POST /release_memory_occupation          |
| `resume_memory_occupation(tags=None)`    | POST /resume_memory_occupation           |
| `init_weights_update_group(payload)`     | POST /init_weights_update_group          |
| `begin_weight_update(selector)`          | POST /begin_weight_update                |
| `update_weights_from_distributed(p)`     | POST /update_weights_from_distributed    |
| `update_weights_from_tensor(p)`          | POST /update_weights_from_tensor         |
| `update_weights_from_disk(p)`            | POST /update_weights_from_disk           |
| `end_weight_update()`                    | POST /end_weight_update                  |
| `get_weights_by_name(p)`                 | POST /get_weights_by_name                |
| `weights_checker(p)`                     | POST /weights_checker                    |

Payloads are SGLang's io_struct fields (see `slime_spec.sglang_contract`). A JSON object answer
is returned as is; a non-JSON answer as `{"text": body}`; an empty one as `{}`. A non-2xx answer
or a `"success": false` answer raises `EngineHTTPError` (status and body attached): a failed weight
update never passes silently.
`url` is a property for local use; from Ray call `get_url()`.
"""

from __future__ import annotations

import atexit
import json
from pathlib import Path

import ray
import requests

from slime_spec.config import EngineConfig
from slime_spec.rollout.engine_process import ServerProcess, engine_server_process

DEFAULT_HTTP_TIMEOUT_S = 600.0


class EngineHTTPError(RuntimeError):
    def __init__(self, url: str, status: int, body: str):
        self.status, self.body = status, body
        super().__init__(f"{url} answered HTTP {status}: {body[:2000]}")


def parse_response(url: str, status: int, body: str) -> dict:
    if not 200 <= status < 300:
        raise EngineHTTPError(url, status, body)
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return {"text": body}
    if isinstance(data, dict) and data.get("success") is False:
        raise EngineHTTPError(url, status, body)
    return data if isinstance(data, dict) else {"result": data}


class Engine:
    def __init__(self, engine: EngineConfig, index: int, *, log_dir: str, host: str | None = None,
                 start_timeout_s: float = 300.0, gpu_ids: list[int] | None = None,
                 http_timeout_s: float = DEFAULT_HTTP_TIMEOUT_S):
        self.index, self.start_timeout_s, self.http_timeout_s = index, start_timeout_s, http_timeout_s
        self.restarts = 0
        self.process: ServerProcess = engine_server_process(
            engine, log_path=Path(log_dir) / f"engine_{index}.log", host=host or node_host(), gpu_ids=gpu_ids)
        self._http = requests.Session()
        atexit.register(self.shutdown)
        self.process.start(start_timeout_s)

    # ---- lifecycle ----
    @property
    def url(self) -> str:
        return self.process.url

    def get_url(self) -> str:
        return self.url

    def pid(self) -> int | None:
        return self.process.pid

    def log_path(self) -> str:
        return str(self.process.log_path)

    def alive(self) -> bool:
        return self.process.alive()

    def restart(self) -> str:
        """Stop and start the server with the same argv (same port); returns the url."""
        self.process.stop()
        self.process.start(self.start_timeout_s)
        self.restarts += 1
        return self.url

    def ensure_alive(self) -> bool:
        """Restart the server if its process has died (or stopped answering /health); True if it restarted."""
        if self.process.alive():
            try:
                if self._http.get(f"{self.url}/health", timeout=30).status_code == 200:
                    return False
            except requests.RequestException as e:
                print(f"[engine {self.index}] /health failed ({type(e).__name__}: {e}); restarting", flush=True)
        self.restart()
        return True

    def shutdown(self) -> int | None:
        """Stop the server and every process in its group; safe to call twice."""
        return self.process.stop()

    # ---- HTTP ----
    def post(self, path: str, payload: dict | None = None, timeout: float | None = None) -> dict:
        r = self._http.post(f"{self.url}{path}", json=payload if payload is not None else {},
                            timeout=timeout or self.http_timeout_s)
        return parse_response(f"{self.url}{path}", r.status_code, r.text)

    def get(self, path: str, timeout: float | None = None) -> dict:
        r = self._http.get(f"{self.url}{path}", timeout=timeout or self.http_timeout_s)
        return parse_response(f"{self.url}{path}", r.status_code, r.text)

    def generate(self, payload: dict) -> dict:
        return self.post("/generate", payload)

    def get_server_info(self) -> dict:
        return self.get("/get_server_info")

    def flush_cache(self) -> dict:
        return self.post("/flush_cache")

    def pause_generation(self, mode: str = "abort") -> dict:
        return self.post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self.post("/continue_generation")

    def abort_request(self, rid: str | None = None) -> dict:
        return self.post("/abort_request", {"rid": rid} if rid else {"abort_all": True})

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self.post("/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self.post("/resume_memory_occupation", {"tags": tags})

    def init_weights_update_group(self, payload: dict) -> dict:
        return self.post("/init_weights_update_group", payload)

    def begin_weight_update(self, selector: str = "all") -> dict:
        return self.post("/begin_weight_update", {"selector": selector})

    def end_weight_update(self) -> dict:
        return self.post("/end_weight_update")

    def update_weights_from_distributed(self, payload: dict) -> dict:
        return self.post("/update_weights_from_distributed", payload)

    def update_weights_from_tensor(self, payload: dict) -> dict:
        return self.post("/update_weights_from_tensor", payload)

    def update_weights_from_disk(self, payload: dict) -> dict:
        return self.post("/update_weights_from_disk", payload)

    def get_weights_by_name(self, payload: dict) -> dict:
        return self.post("/get_weights_by_name", payload)

    def weights_checker(self, payload: dict) -> dict:
        return self.post("/weights_checker", payload)


EngineActor = ray.remote(Engine)


def node_host() -> str:
    """127.0.0.1 on a one-node Ray cluster; the node's address when engines may be reached from other nodes."""
    if ray.is_initialized() and sum(bool(n.get("Alive")) for n in ray.nodes()) > 1:
        return ray.util.get_node_ip_address()
    return "127.0.0.1"
