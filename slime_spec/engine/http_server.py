"""SGLang's native HTTP API over the embedded engine (FastAPI + uvicorn).

Paths, request fields, response fields and status codes follow SGLang 0.5.23's
`entrypoints/http_server.py`. Every handler validates its body against SGLang's io_struct class
(`slime_spec.sglang_contract`), posts work to the engine thread (`scheduler.EngineLoop`) and
awaits the result; a bad request gets a 400 (413 when too large) whose message names the field and the
fix, and never reaches the engine; no input makes a 500.

Health, as SGLang 0.5.23 splits it (its default SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=1):
- `/health` and `/health_generate`: can this server generate now? 503 at once, with the reason, while the
  engine is dead, broken, stuck inside one operation over SGLANG_HEALTH_CHECK_TIMEOUT (a hung weight sync),
  paused, or with its memory released; else 200 once one token is generated (or, while busy, once the
  engine answers between steps), 503 after the timeout. SGLang holds a probe at its pause gate until the
  timeout; this server answers at once.
- `/ping` (SGLang's SageMaker route): liveness only; a paused or released server still answers 200.
- `/ready`: 200 when alive and neither paused nor released.
A /generate while memory is released gets 503 naming /resume_memory_occupation (SGLang has no guard).

The body of any request is limited to MAX_REQUEST_BODY_BYTES (32 MiB, 413) and MAX_JSON_DEPTH levels; a
/generate is planned (tokenized) on a worker thread, so /health never waits on one request's tokenizing.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from slime_spec.engine.io_struct import (EXTERNAL_CORPUS_MAX_TOKENS, NGRAM_OFF_MESSAGE,
                                         SEQUENCES_PER_RUNNING_REQUEST, build_response, check_field_types,
                                         explain_contract_error, longest_token_chars, plan_external_corpus,
                                         plan_generate, pop_history_extension)
from slime_spec.engine.scheduler import EngineLoop, Unavailable
from slime_spec.engine.server_args import EngineServerArgs
from slime_spec.engine.weight_updater import WeightUpdater
from slime_spec.sglang_contract import validate_payload

logger = logging.getLogger(__name__)

MAX_REQUEST_BODY_BYTES = 32 << 20
MAX_JSON_DEPTH = 32  # SGLang's request bodies nest at most 3 levels (a batch of token-id lists)
# Routes SGLang marks @auth_level(AuthLevel.ADMIN_OPTIONAL); every other route is NORMAL.
ADMIN_OPTIONAL_PATHS = frozenset({
    "/flush_cache", "/abort_request", "/pause_generation", "/continue_generation", "/release_memory_occupation",
    "/resume_memory_occupation", "/update_weight_version", "/begin_weight_update", "/end_weight_update",
    "/abort_weight_update", "/update_weights_from_disk", "/init_weights_update_group", "/destroy_weights_update_group",
    "/update_weights_from_distributed", "/update_weights_from_tensor", "/get_weights_by_name", "/weights_checker",
    "/add_external_corpus", "/remove_external_corpus", "/list_external_corpora", "/freeze_gc",
})


class BadRequest(Exception):
    """Answered as SGLang's _create_error_response: {"error": {"message": ...}}, 400 unless told otherwise."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


def freeze_gc(gc_threshold: tuple[int, ...] | None = None) -> int:
    """SGLang's post-warm-up `freeze_gc`: set `--gc-threshold` if given, then move every object alive now (the model,
    the tokenizer, the app) into the collector's permanent generation, so generation-2 passes stop scanning them.
    Without it a pass over this process's heap held the GIL for about 0.3 s in the middle of a rollout on the demo's
    CPU engine. Garbage in cycles is collected first, so none of it is kept for good. Returns how many objects
    were frozen."""
    if gc_threshold is not None:
        gc.set_threshold(*gc_threshold)
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def error_response(message: str, status_code: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status_code)


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, d = stack.pop()
        if isinstance(item, (dict, list)):
            depth = max(depth, d)
            stack.extend((v, d + 1) for v in (item.values() if isinstance(item, dict) else item))
    return depth


async def read_raw_body(request: Request) -> bytes:
    """The body, refused with 413 past MAX_REQUEST_BODY_BYTES before it is all read."""
    too_large = BadRequest(f"the request body is over the server's limit of {MAX_REQUEST_BODY_BYTES >> 20} MiB "
                           "(MAX_REQUEST_BODY_BYTES); send a smaller request, e.g. split the batch", 413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_REQUEST_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body(request: Request, struct_name: str | None) -> dict:
    raw = await read_raw_body(request)
    try:
        body = json.loads(raw) if raw.strip() else {}
    except RecursionError as e:
        raise BadRequest(f"the request body nests too deeply to parse (limit {MAX_JSON_DEPTH} levels); "
                         "flatten it") from e
    except ValueError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise BadRequest(f"the request body nests {depth} levels deep, over the limit of {MAX_JSON_DEPTH} "
                         "(MAX_JSON_DEPTH); flatten it")
    if struct_name is not None:
        try:
            validate_payload(struct_name, body)
            check_field_types(struct_name, body)
        except ValueError as e:
            raise BadRequest(str(e)) from e
    return body


class AsciiBearer:
    """Pure ASGI: a non-ASCII Authorization header gets 401 with a message instead of a crash in the key check."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            for name, value in scope.get("headers", []):
                if name.lower() == b"authorization" and not value.isascii():
                    await JSONResponse({"error": "Unauthorized: the Authorization header is not ASCII; send "
                                                 "'Bearer <the --api-key value>'"}, 401)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def add_auth(app: FastAPI, api_key: str | None, admin_api_key: str | None) -> None:
    """SGLang's own API-key middleware (sglang.srt.utils.auth), with SGLang's per-route auth levels.

    It is a pure ASGI middleware, so a handler still sees its client disconnect.
    """
    from sglang.srt.utils.auth import AuthLevel, add_api_key_middleware

    for route in app.routes:
        if getattr(route, "path", None) in ADMIN_OPTIONAL_PATHS:
            route.endpoint._auth_level = AuthLevel.ADMIN_OPTIONAL
    add_api_key_middleware(app, api_key=api_key, admin_api_key=admin_api_key)
    app.add_middleware(AsciiBearer)  # added last, so it runs first


def create_app(args: EngineServerArgs, loop: EngineLoop, weights: WeightUpdater) -> FastAPI:
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.version import __version__ as sglang_version

    from slime_spec.engine.core import Request as EngineRequest
    from slime_spec.engine.drafters.history import SEPARATOR, HistoryRef

    app = FastAPI(title="slime-spec embedded engine")
    startup_time = time.time()
    spec_enabled = args.spec is not None
    health_timeout = args.health_check_timeout_s
    planner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")  # one tokenizer user at a time
    max_token_chars = 0 if args.skip_tokenizer_init else longest_token_chars(loop.core.tokenizer)
    max_sequences = SEQUENCES_PER_RUNNING_REQUEST * args.max_running_requests

    async def on_engine(fn: Callable[[Any], Any], needs_idle: bool = False, label: str = "a call") -> Any:
        return await asyncio.wrap_future(loop.call(fn, needs_idle, label))

    async def weight_call(fn: Callable[[Any, dict], dict], body: dict, needs_idle: bool, route: str) -> JSONResponse:
        if body.get("abort_all_requests"):
            await on_engine(lambda core: loop.abort(None))
        out = await on_engine(lambda core: fn(core, body), needs_idle=needs_idle, label=route)
        return JSONResponse(out, status_code=200 if out["success"] else 400)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, e: BadRequest):
        return error_response(str(e), e.status_code)

    @app.exception_handler(ValueError)
    async def value_error(_: Request, e: ValueError):
        return error_response(str(e))

    @app.exception_handler(Unavailable)
    async def unavailable(_: Request, e: Unavailable):
        return error_response(str(e), 503)

    @app.exception_handler(RequestValidationError)
    async def bad_query(_: Request, e: RequestValidationError):
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(f"{where}={first.get('input')!r}: {first.get('msg')}; fix {where}")

    @app.exception_handler(TypeError)
    @app.exception_handler(KeyError)
    async def malformed_field(request: Request, e: Exception):
        logger.warning("malformed request to %s", request.url.path, exc_info=e)
        return error_response(f"a field of the request to {request.url.path} has the wrong type or is missing "
                              f"({e!r}); check the body against SGLang's request struct for this route")

    # ------------------------------------------------------------------ health and info
    def unhealthy(reason: str) -> Response:
        return error_response(reason, 503)

    @app.get("/health")
    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Can this server generate now (see the module docstring)? One token if idle, else the engine answers."""
        from slime_spec.engine.core import SamplingParams

        reason = loop.health_problem(health_timeout) or loop.generation_blocked()
        if reason is not None:
            return unhealthy(reason)

        async def probe() -> None:
            if await on_engine(lambda core: not core.has_work() and not loop.paused, label="a health check"):
                req = EngineRequest(f"HEALTH_CHECK_{time.time_ns()}", [0], SamplingParams(temperature=0.0,
                                                                                          max_new_tokens=1))
                await asyncio.wrap_future(loop.generate(req))

        try:
            await asyncio.wait_for(probe(), health_timeout)
        except asyncio.TimeoutError:
            return unhealthy(f"the engine did not answer within SGLANG_HEALTH_CHECK_TIMEOUT={health_timeout:g} s")
        except Unavailable as e:
            return unhealthy(str(e))
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        reason = loop.health_problem(health_timeout)
        return Response(status_code=200) if reason is None else unhealthy(reason)

    @app.get("/ready")
    async def ready() -> Response:
        reason = loop.health_problem(health_timeout) or loop.generation_blocked()
        return Response(status_code=200) if reason is None else unhealthy(reason)

    def model_info_body() -> dict:
        cfg = loop.core.model_config
        return {"model_path": weights.model_path, "served_model_name": args.served_model_name,
                "tokenizer_path": args.model_path, "is_generation": True, "preferred_sampling_params": None,
                "weight_version": weights.weight_version, "load_format": "auto", "reasoning_parser": None,
                "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": cfg.get("model_type"),
                "architectures": cfg.get("architectures")}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return model_info_body()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        state = {**args.sglang_args, "world_size": 1, "startup_time": startup_time,
                 "effective_max_running_requests_per_dp": args.max_running_requests,
                 "last_gen_throughput": loop.stats["last_gen_throughput"], **loop.load(),
                 "engine_step_s": loop.stats["engine_step_s"]}  # slime-spec: seconds inside engine steps since start
        if spec_enabled:
            state["avg_spec_accept_length"] = loop.stats["avg_spec_accept_length"]
            state["spec_step_times"] = loop.core.step_times.as_dict()  # slime-spec: per phase (StepTimes)
        resolved = {**args.sglang_args, "device": args.device, "dtype": args.dtype, "random_seed": args.random_seed,
                    **(args.spec.server_args() if spec_enabled else {})}
        return {**resolved, "weight_version": weights.weight_version, "startup_time": startup_time,
                "internal_states": [state], "version": sglang_version, "frontend": "python",
                "backend": "slime_spec.engine"}

    # ------------------------------------------------------------------ generation
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = await read_body(request, None)
        try:
            ext = pop_history_extension(body)
        except ValueError as e:
            return error_response(str(e))
        history = None if ext is None else HistoryRef(ext.get("group"), ext.get("corpus_id"))
        contract_error = generate_contract_error(body)
        if contract_error is not None:  # SGLang's shape: {"error": "<message>"}
            return JSONResponse({"error": explain_contract_error(body, contract_error, generate_contract_error)},
                                status_code=400)
        start = time.perf_counter()
        core = loop.core
        planned, is_single = await asyncio.get_running_loop().run_in_executor(
            planner, lambda: plan_generate(body, core.tokenizer, core.vocab_size, core.context_length,
                                           args.skip_tokenizer_init, max_sequences=max_sequences,
                                           max_token_chars=max_token_chars))
        futures = [asyncio.wrap_future(loop.generate(EngineRequest(p.rid, p.input_ids, p.params, p.return_logprob,
                                                                   history=history)))
                   for p in planned]
        pending = set(futures)
        while pending:  # like SGLang, a client that went away aborts its requests
            _, pending = await asyncio.wait(pending, timeout=1.0)
            if pending and await request.is_disconnected():
                rids = [p.rid for p in planned]
                await on_engine(lambda core: loop.abort_many(rids, "client disconnected"))
                return Response(status_code=499)
        outs = await asyncio.gather(*futures, return_exceptions=True)
        errors = [o for o in outs if isinstance(o, BaseException)]
        if errors:
            if isinstance(errors[0], Unavailable):
                return error_response(str(errors[0]), 503)
            if not isinstance(errors[0], ValueError):
                raise errors[0]
            return error_response(str(errors[0]))
        latency = time.perf_counter() - start
        responses = [build_response(o, p, tokenizer=core.tokenizer, spec_enabled=spec_enabled,
                                    weight_version=weights.weight_version, e2e_latency=latency,
                                    skip_tokenizer_init=args.skip_tokenizer_init) for o, p in zip(outs, planned)]
        return responses[0] if is_single else responses

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await read_body(request, "AbortReq")
        rid = None if body.get("abort_all") else body.get("rid") or ""
        if rid != "":
            await on_engine(lambda core: loop.abort(rid, body.get("abort_message") or "Abort request"))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await read_body(request, "PauseGenerationReqInput")
        await on_engine(lambda core: loop.pause(body.get("mode", "abort")))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await read_body(request, "ContinueGenerationReqInput")
        await on_engine(lambda core: loop.resume())
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/freeze_gc", methods=["GET", "POST"])
    async def freeze_gc_route():
        frozen = freeze_gc(args.gc_threshold)
        logger.debug("froze the collector: %d objects in the permanent generation", frozen)
        return Response(content="Garbage collection frozen.\n", status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = 0.0):
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            ok = await on_engine(lambda core: core.flush_cache())
            if ok or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        if ok:
            return Response("Cache flushed.\nPlease check backend logs for more details. (When there are running "
                            "or waiting requests, the operation will not be performed.)\n", status_code=200)
        return Response("Cache not flushed because there are pending requests.\n", status_code=400)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory(request: Request):
        body = await read_body(request, "ReleaseMemoryOccupationReqInput")
        await on_engine(lambda core: core.release_memory(body.get("tags")))

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory(request: Request):
        body = await read_body(request, "ResumeMemoryOccupationReqInput")
        await on_engine(lambda core: core.resume_memory(body.get("tags")))

    # ------------------------------------------------------------------ weights
    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await read_body(request, "UpdateWeightVersionReqInput")
        if body.get("abort_all_requests", True):
            await on_engine(lambda core: loop.abort(None))
        weights.weight_version = body["new_version"]
        return {"success": True, "message": f"Weight version updated to {body['new_version']}",
                "new_version": body["new_version"]}

    routes = [  # path, WeightUpdater method, SGLang io_struct class, waits for the engine to drain
        ("/begin_weight_update", weights.begin, "BeginWeightUpdateReqInput", True),
        ("/end_weight_update", weights.end, "EndWeightUpdateReqInput", True),
        # slime-spec extension (not in SGLang): roll back and close the open weight-update session
        ("/abort_weight_update", weights.abort, "EndWeightUpdateReqInput", True),
        ("/init_weights_update_group", weights.init_group, "InitWeightsUpdateGroupReqInput", False),
        ("/destroy_weights_update_group", weights.destroy_group, "DestroyWeightsUpdateGroupReqInput", False),
        ("/update_weights_from_distributed", weights.update_from_distributed, "UpdateWeightsFromDistributedReqInput",
         True),
        ("/update_weights_from_tensor", weights.update_from_tensor, "UpdateWeightsFromTensorReqInput", True),
        ("/update_weights_from_disk", weights.update_from_disk, "UpdateWeightFromDiskReqInput", True),
    ]
    def weight_route(path: str, method: Callable[[Any, dict], dict], struct: str, needs_idle: bool):
        async def route(request: Request):
            return await weight_call(method, await read_body(request, struct), needs_idle, path)
        return route

    for path, method, struct, needs_idle in routes:
        app.post(path, name=path.strip("/"))(weight_route(path, method, struct, needs_idle))

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        body = await read_body(request, "GetWeightsByNameReqInput")
        out = await on_engine(lambda core: weights.get_weights_by_name(core, body))
        if out is None:
            return error_response("Get parameter by name failed")  # SGLang's exact message (clients match it)
        return out

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(request: Request):
        body = await read_body(request, "CheckWeightsReqInput")
        out = await on_engine(lambda core: weights.check_weights(core, body))
        return JSONResponse(out, status_code=200 if out["success"] else 400)

    # ------------------------------------------------------------------ NGRAM external corpora (SGLang 0.5.23)
    def corpus_reply(body: dict, ok: bool) -> JSONResponse:
        return JSONResponse(body, status_code=200 if ok else 400)

    def corpora_of(core):
        has = getattr(core.drafter, "add_corpus", None) is not None
        return core.drafter if has else None

    @app.post("/add_external_corpus")
    async def add_external_corpus(request: Request):
        body = await read_body(request, None)
        try:
            validate_payload("AddExternalCorpusReqInput", body)
            check_field_types("AddExternalCorpusReqInput", body)
        except ValueError as e:
            return corpus_reply({"success": False, "message": str(e)}, False)
        fail = {"success": False, "corpus_id": "", "loaded_token_count": 0}
        if corpora_of(loop.core) is None:
            return corpus_reply({**fail, "message": NGRAM_OFF_MESSAGE}, False)
        try:
            cid, chunks, truncated = await asyncio.get_running_loop().run_in_executor(
                planner, lambda: plan_external_corpus(body, loop.core.tokenizer, EXTERNAL_CORPUS_MAX_TOKENS,
                                                      SEPARATOR))

            def load(core) -> int:
                drafter = corpora_of(core)
                budget = EXTERNAL_CORPUS_MAX_TOKENS - drafter.corpus_tokens()
                size = sum(len(c) for c in chunks)
                if size > budget:
                    raise ValueError(f"External ngram corpus exceeds the remaining token budget ({budget}) after "
                                     f"loading 0 tokens.")
                return drafter.add_corpus(cid, chunks)

            loaded = await on_engine(load, label="/add_external_corpus")
        except ValueError as e:
            return corpus_reply({**fail, "message": str(e)}, False)
        message = f"Loaded corpus '{cid}' with {loaded} tokens."
        if truncated:
            message += f" (truncated: exceeded {EXTERNAL_CORPUS_MAX_TOKENS} token limit)"
        return corpus_reply({"success": True, "corpus_id": cid, "message": message, "loaded_token_count": loaded},
                            True)

    @app.post("/remove_external_corpus")
    async def remove_external_corpus(request: Request):
        body = await read_body(request, None)
        cid = body.get("corpus_id")
        if not cid:
            return corpus_reply({"success": False, "message": "corpus_id is required."}, False)
        if corpora_of(loop.core) is None:
            return corpus_reply({"success": False, "message": NGRAM_OFF_MESSAGE}, False)
        await on_engine(lambda core: corpora_of(core).remove_corpus(cid), label="/remove_external_corpus")
        return corpus_reply({"success": True, "message": f"Removed corpus '{cid}'."}, True)

    @app.get("/list_external_corpora")
    async def list_external_corpora():
        if corpora_of(loop.core) is None:
            return corpus_reply({"success": False, "corpus_token_counts": {}, "message": NGRAM_OFF_MESSAGE}, False)
        counts = await on_engine(lambda core: corpora_of(core).list_corpora(), label="/list_external_corpora")
        return corpus_reply({"success": True, "corpus_token_counts": counts, "message": ""}, True)

    if args.api_key or args.admin_api_key:
        add_auth(app, args.api_key, args.admin_api_key)
    return app
