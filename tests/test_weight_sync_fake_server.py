"""`FakeSGLangServer`: a test double of SGLang's weight-update HTTP routes, and the protocol tests run on it.

Why a double: a real SGLang server needs CUDA. The double keeps what the weight sync depends on,
read from sglang 0.5.23 (scheduler_components/weight_updater.py, http_server.py):
- every body is validated against SGLang's own io_struct class (`sglang_contract.validate_payload`);
- target weights are stored the way SGLang's models store them: q/k/v fused into `qkv_proj`, gate/up
  into `gate_up_proj`; loading maps HF names onto them (a name the target does not serve, e.g. an MTP
  layer, is skipped, as SGLang's loaders do);
- a draft runner: native MTP (`model.mtp_layers.*` plus its own copy of embed_tokens / lm_head, as
  mimo_mtp.py loads them) or an external draft with its own same-named weights (the slime#1177 trap);
- updates outside a session fail; `selector` picks runners; disk reloads every runner; the
  distributed path receives over a real gloo group; each request is all-or-nothing;
- `/weights_checker` answers what SGLang's WeightChecker computes for those runners (names and values by
  weight_sync/verify/sglang_params.py, which tests/conformance/test_weight_checker.py checks against SGLang's model
  classes);
- `session_routes=False` models an older SGLang: no session routes (404), no `selector`, distributed
  loads the target only (sglang#27718), tensor and disk load every runner.
"""

from __future__ import annotations

import base64
import json
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from slime_spec.fleet.sglang_contract import struct, validate_payload
from slime_spec.weight_sync import protocol
from slime_spec.weight_sync.verify import coverage as verify
from slime_spec.weight_sync.verify import sglang_params

_STRUCTS = {**protocol.ROUTE_STRUCTS, "/generate": None, "/flush_cache": None}


def fuse_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors -> SGLang's served layout (qkv_proj, gate_up_proj)."""
    out = {n: t.clone() for n, t in state.items() if verify.fused_name(n) is None}
    for n in state:
        fused = verify.fused_name(n)
        if fused is not None and fused not in out:
            out[fused] = torch.cat([state[p] for p in verify.stacked_parts(fused)], dim=0)
    return out


class Runner:
    """One runner's weights (SGLang layout) and its loader."""

    def __init__(self, weights: dict[str, torch.Tensor], kv_rows: int, accepts=lambda name: True):
        self.weights, self.kv_rows, self.accepts = weights, kv_rows, accepts

    def serves(self, name: str) -> bool:
        return self.accepts(name) and (name in self.weights or verify.fused_name(name) in self.weights)

    def plan_load(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, slice | None, torch.Tensor]]:
        """Validate every tensor first (all-or-nothing): (served name, row slice of a fused param, tensor)."""
        writes = []
        for name, t in named:
            if not self.serves(name):
                continue  # SGLang's loaders skip names the model does not have (e.g. MTP layers on the target)
            target, rows = self._locate(name)
            expected = self.weights[target][rows] if rows else self.weights[target]
            if tuple(expected.shape) != tuple(t.shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} does not match served {tuple(expected.shape)}")
            writes.append((target, rows, t))
        return writes

    def read(self, name: str) -> torch.Tensor:
        """An HF-named weight, sliced out of its fused parameter if need be (SGLang's get_weights_by_name)."""
        target, rows = self._locate(name)
        return self.weights[target][rows] if rows else self.weights[target]

    def _locate(self, name: str) -> tuple[str, slice | None]:
        if name in self.weights:
            return name, None
        fused = verify.fused_name(name)
        parts = verify.stacked_parts(fused)
        total = self.weights[fused].shape[0]
        # gate/up halves; q then k and v of kv_rows each
        sizes = [total // 2] * 2 if len(parts) == 2 else [total - 2 * self.kv_rows, self.kv_rows, self.kv_rows]
        start = sum(sizes[: parts.index(name)])
        return fused, slice(start, start + sizes[parts.index(name)])

    def hf_named(self) -> list[tuple[str, torch.Tensor]]:
        """The runner's weights by checkpoint name (a fused parameter split into its parts)."""
        out = []
        for name in self.weights:
            out += [(p, self.read(p)) for p in (verify.stacked_parts(name) or [name])]
        return out

    def apply(self, writes) -> None:
        with torch.no_grad():
            for target, rows, t in writes:
                dst = self.weights[target][rows] if rows else self.weights[target]
                dst.copy_(t.to(dst.dtype))


class FakeSGLangServer:
    """Serve SGLang's weight routes on 127.0.0.1 in a thread; `calls` records (path, body) of every request."""

    def __init__(self, hf_state: dict[str, torch.Tensor], hf_config: dict, *, draft: str | None = None,
                 draft_state: dict[str, torch.Tensor] | None = None, session_routes: bool = True,
                 version: str | None = None, fail_on_name: str | None = None):
        self.session_routes = session_routes
        self.version = version or ("0.5.23" if session_routes else "0.4.10.post2")
        self.fail_on_name = fail_on_name
        self.calls: list[tuple[str, dict]] = []  # POSTs: (path, body without tensor data)
        self.session: str | None = None
        self.paused = False
        self.weight_version = "default"  # as SGLang's /model_info reports it; set by an applied update
        self.group = None
        head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
        kv_rows = hf_config["num_key_value_heads"] * head_dim

        def is_mtp(name: str) -> bool:
            return name.startswith("model.mtp_layers.")

        self.contract_errors: list[str] = []
        self.target = Runner(fuse_hf_state({n: t for n, t in hf_state.items() if not is_mtp(n)}), kv_rows,
                             accepts=lambda n: not is_mtp(n))
        self.draft = None
        # how SGLang serves each runner: MiMoMTP; an EAGLE3 checkpoint (fc + midlayer) as LlamaForCausalLMEagle3;
        # any other external draft as a causal LM
        # in the dtype SGLang serves for --dtype auto (`dtype` in /server_info)
        eagle3 = draft_state is not None and "fc.weight" in draft_state
        dtype = sglang_params.served_dtype(hf_config, "auto")
        self.layouts = {"target": sglang_params.RunnerLayout.target(hf_config, dtype),
                        "draft": (sglang_params.RunnerLayout.mtp_draft(hf_config, dtype) if draft == "mtp" else
                                  sglang_params.RunnerLayout.eagle3_draft(dtype) if eagle3 else
                                  sglang_params.RunnerLayout.target(hf_config, dtype))}
        if draft == "mtp":
            shared = ("model.embed_tokens.weight", "lm_head.weight")
            own = {n: t for n, t in hf_state.items() if is_mtp(n) or n in shared}
            self.draft = Runner(fuse_hf_state(own), kv_rows, accepts=lambda n: is_mtp(n) or n in shared)
        elif draft == "external":
            self.draft = Runner(fuse_hf_state(draft_state), kv_rows)
        # Read SGLang's io_struct once before handler threads do: concurrent ast.parse calls can fail on
        # CPython 3.11 ("AST constructor recursion depth mismatch").
        struct("GenerateReqInput")
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def paths(self) -> list[str]:
        """The POSTed routes, in order."""
        return [p for p, _ in self.calls]

    # ---- route logic ----
    def _runners(self, selector: str) -> list[Runner]:
        roles = {"all": ("target", "draft"), "target": ("target",), "draft": ("draft",)}[selector]
        return [r for role, r in (("target", self.target), ("draft", self.draft)) if role in roles and r]

    def _load(self, named: list[tuple[str, torch.Tensor]], runners: list[Runner]) -> None:
        if self.fail_on_name and any(n == self.fail_on_name for n, _ in named):
            raise RuntimeError(f"injected failure while loading {self.fail_on_name}")
        plans = [(r, r.plan_load(named)) for r in runners]
        unknown = [n for n, _ in named if not any(r.serves(n) for r in (self.target, self.draft) if r)]
        if unknown:
            raise ValueError(f"unknown parameter(s) {unknown[:3]}")
        for r, writes in plans:
            r.apply(writes)

    def _update_runners(self, body: dict, default_all: bool) -> list[Runner]:
        if not self.session_routes:
            return self._runners("all" if default_all else "target")
        if self.session is None:
            raise RuntimeError("must run between begin_weight_update() and end_weight_update()")
        return self._runners(body.get("selector", "all"))

    def handle(self, method: str, path: str, body: dict) -> tuple[int, dict]:
        if method == "POST":
            self.calls.append((path, {k: v for k, v in body.items() if k != "serialized_named_tensors"}))
        if path in ("/begin_weight_update", "/end_weight_update", "/weights_checker") and not self.session_routes:
            return 404, {"detail": "Not Found"}
        if method == "GET":
            if path in ("/get_server_info", "/server_info"):
                return 200, {"version": self.version, "dtype": "auto", "device": "cpu", "internal_states": [{}]}
            if path == "/model_info":
                return 200, {"model_path": "/ckpt", "weight_version": self.weight_version}
            if path in protocol.ROUTE_STRUCTS:
                return 405, {"detail": "Method Not Allowed"}
            return 404, {"detail": "Not Found"}
        struct = _STRUCTS.get(path, "missing")
        if struct == "missing":
            return 404, {"detail": "Not Found"}
        if struct is not None:
            try:
                validate_payload(struct, body)
                if not self.session_routes and "selector" in body:
                    raise ValueError(f"{struct} of SGLang {self.version} has no field `selector`")
            except ValueError as e:
                self.contract_errors.append(f"{path}: {e}")
                return 422, {"detail": str(e)}
        try:
            reply = self._route(path, body)
        except Exception as e:  # an SGLang route answers 400 {success: false, message}
            return 400, {"success": False, "message": f"{type(e).__name__}: {e}"}
        if path.startswith("/update_weights_from") and body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return 200, reply

    def _route(self, path: str, body: dict) -> dict:
        ok = {"success": True, "message": "Success"}
        if path == "/pause_generation":
            self.paused = True
            return {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            self.paused = False
            return {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/flush_cache":
            return {}
        if path == "/update_weight_version":  # SGLang's route answers 200 with no body fields
            self.weight_version = body["new_version"]
            return {}
        if path == "/begin_weight_update":
            if self.session is not None:
                raise RuntimeError("a weight-update session is already open")
            self.session = body.get("selector", "all")
            return ok
        if path == "/end_weight_update":
            if self.session is None:
                raise RuntimeError("no weight-update session is open")
            self.session = None
            return ok
        if path == "/init_weights_update_group":
            from slime_spec.common.dist_group import WeightUpdateGroup
            self.group = WeightUpdateGroup(body["master_address"], body["master_port"], body["rank_offset"],
                                           body["world_size"], body["group_name"], body["backend"])
            return ok
        if path == "/destroy_weights_update_group":
            self.group.destroy()
            self.group = None
            return ok
        if path == "/update_weights_from_distributed":
            runners = self._update_runners(body, default_all=False)
            named = []
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                self.group.broadcast(t, src=0)
                named.append((name, t))
            self._load(named, runners)
            return ok
        if path == "/update_weights_from_tensor":
            runners = self._update_runners(body, default_all=True)
            named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
            if body.get("load_format") == "flattened_bucket":  # rebuilt as SGLang's model runner does
                from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

                named = FlattenedTensorBucket(flattened_tensor=named["flattened_tensor"],
                                              metadata=named["metadata"]).reconstruct_tensors()
            self._load(named, runners)
            return ok
        if path == "/update_weights_from_disk":
            from safetensors.torch import load_file

            named = []
            for f in sorted(Path(body["model_path"]).glob("*.safetensors")):
                named += list(load_file(str(f)).items())
            self._load(named, self._runners("all"))
            return ok
        if path == "/weights_checker":
            checksums = {}
            for role, runner in (("target", self.target), ("draft", self.draft)):
                if runner and runner in self._runners(body.get("selector", "all")):
                    served = sglang_params.served_tensors(runner.hf_named(), self.layouts[role])
                    for n, t in served.items():
                        checksums[n if role == "target" else f"draft.{n}"] = sglang_params.checksum(t)
            info = {"checksums": checksums, "per_gpu_checksum": "x", "parallelism_info": [
                {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                 "pp_size": 1, "rank": 0, "size": 1}]}
            return {"success": True, "message": "Success.", "ranks": [info], "per_engine_checksum": "x"}
        if path == "/get_weights_by_name":  # SGLang answers the bare list, first `truncate_size` rows
            return self.target.read(body["name"]).tolist()[: body.get("truncate_size", 100)]
        raise KeyError(path)

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else {}
                status, reply = server.handle(method, self.path, body or {})
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        return Handler


# ---------------------------------------------------------------- tests of the protocol against the double

def _tiny_state(seed: int = 0, mtp: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    from slime_spec.tools.tiny_model import make_config, make_weights
    config = make_config("mimo" if mtp else "llama", vocab_size=48, hidden_size=32, num_layers=1, num_heads=4,
                         num_kv_heads=2, intermediate_size=64, max_position_embeddings=128, dtype="float32",
                         mtp_layers=1 if mtp else 0, tie_word_embeddings=False)
    return make_weights(config, seed), config


@pytest.fixture
def servers():
    made = []

    def make(*args, **kwargs) -> FakeSGLangServer:
        made.append(FakeSGLangServer(*args, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_protocol_detected_from_new_and_old_server(servers):
    from slime_spec.fleet.client import EngineClient
    from slime_spec.weight_sync.protocol import detect_engine_protocol
    state, config = _tiny_state()
    new = detect_engine_protocol(EngineClient(servers(state, config).url))
    old = detect_engine_protocol(EngineClient(servers(state, config, session_routes=False).url))
    assert (new.session, new.version) == (True, "0.5.23")
    assert (old.session, old.version) == (False, "0.4.10.post2")


def test_fake_rejects_update_outside_session_and_bad_fields(servers):
    from slime_spec.fleet.client import EngineClient, EngineError
    state, config = _tiny_state()
    client = EngineClient(servers(state, config).url)
    with pytest.raises(EngineError, match="begin_weight_update"):
        client.post("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]})
    with pytest.raises(EngineError, match="no field"):
        client.post("/begin_weight_update", {"selectr": "all"})
    server = servers(state, config)
    assert server.handle("POST", "/begin_weight_update", {"selectr": "all"})[0] == 422
    assert server.contract_errors and "selectr" in server.contract_errors[0]
