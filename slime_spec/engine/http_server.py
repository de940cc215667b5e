"""SGLang's native HTTP API over the embedded engine (FastAPI + uvicorn).

Paths, request fields, response fields and status codes follow SGLang 0.5.23's
`entrypoints/http_server.py`. Every handler validates its body against SGLang's io_struct class
(`slime_spec.sglang_contract`), posts work to the engine thread (`scheduler.EngineLoop`) and
awaits the result; a bad request gets a 400 with a message and never reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from slime_spec.engine.server_args import EngineServerArgs
from slime_spec.engine.io_struct import build_response, plan_generate
from slime_spec.engine.scheduler import EngineLoop
from slime_spec.engine.weight_updater import WeightUpdater
from slime_spec.sglang_contract import validate_payload

logger = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 20.0
# Routes SGLang marks @auth_level(AuthLevel.ADMIN_OPTIONAL); every other route is NORMAL.
ADMIN_OPTIONAL_PATHS = frozenset({
    "/flush_cache", "/abort_request", "/pause_generation", "/continue_generation", "/release_memory_occupation",
    "/resume_memory_occupation", "/update_weight_version", "/begin_weight_update", "/end_weight_update",
    "/abort_weight_update", "/update_weights_from_disk", "/init_weights_update_group", "/destroy_weights_update_group",
    "/update_weights_from_distributed", "/update_weights_from_tensor", "/get_weights_by_name", "/weights_checker",
})


class BadRequest(Exception):
    """Answered as SGLang's _create_error_response: 400 {"error": {"message": ...}}."""


def error_response(message: str, status_code: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status_code)


async def read_body(request: Request, struct_name: str | None) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    if struct_name is not None:
        try:
            validate_payload(struct_name, body)
        except ValueError as e:
            raise BadRequest(str(e)) from e
    return body


def add_auth(app: FastAPI, api_key: str | None, admin_api_key: str | None) -> None:
    """SGLang's own API-key middleware (sglang.srt.utils.auth), with SGLang's per-route auth levels.

    It is a pure ASGI middleware, so a handler still sees its client disconnect.
    """
    from sglang.srt.utils.auth import AuthLevel, add_api_key_middleware

    for route in app.routes:
        if getattr(route, "path", None) in ADMIN_OPTIONAL_PATHS:
            route.endpoint._auth_level = AuthLevel.ADMIN_OPTIONAL
    add_api_key_middleware(app, api_key=api_key, admin_api_key=admin_api_key)


def create_app(args: EngineServerArgs, loop: EngineLoop, weights: WeightUpdater) -> FastAPI:
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.version import __version__ as sglang_version

    from slime_spec.engine.core import Request as EngineRequest

    app = FastAPI(title="slime-spec embedded engine")
    startup_time = time.time()
    spec_enabled = args.spec is not None

    async def on_engine(fn: Callable[[Any], Any], needs_idle: bool = False) -> Any:
        return await asyncio.wrap_future(loop.call(fn, needs_idle))

    async def weight_call(fn: Callable[[Any, dict], dict], body: dict, needs_idle: bool) -> JSONResponse:
        if body.get("abort_all_requests"):
            await on_engine(lambda core: loop.abort(None))
        out = await on_engine(lambda core: fn(core, body), needs_idle=needs_idle)
        return JSONResponse(out, status_code=200 if out["success"] else 400)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, e: BadRequest):
        return error_response(str(e))

    @app.exception_handler(ValueError)
    async def value_error(_: Request, e: ValueError):
        return error_response(str(e))

    @app.exception_handler(TypeError)
    @app.exception_handler(KeyError)
    async def malformed_field(request: Request, e: Exception):
        logger.warning("malformed request to %s", request.url.path, exc_info=e)
        return error_response(f"malformed request field: {e!r}")

    # ------------------------------------------------------------------ health and info
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if loop.healthy else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Alive if the engine answers; if it is idle and not paused, it must also generate one token."""
        from slime_spec.engine.core import SamplingParams

        async def probe() -> None:
            if await on_engine(lambda core: not core.has_work() and not loop.paused):
                req = EngineRequest(f"HEALTH_CHECK_{time.time_ns()}", [0], SamplingParams(temperature=0.0,
                                                                                          max_new_tokens=1))
                await asyncio.wrap_future(loop.generate(req))

        if not loop.healthy:
            return Response(status_code=503)
        try:
            await asyncio.wait_for(probe(), HEALTH_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)

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
                 "last_gen_throughput": loop.stats["last_gen_throughput"], **loop.load()}
        if spec_enabled:
            state["avg_spec_accept_length"] = loop.stats["avg_spec_accept_length"]
        resolved = {**args.sglang_args, "device": args.device, "dtype": args.dtype, "random_seed": args.random_seed,
                    **(args.spec.server_args() if spec_enabled else {})}
        return {**resolved, "weight_version": weights.weight_version, "startup_time": startup_time,
                "internal_states": [state], "version": sglang_version, "frontend": "python",
                "backend": "slime_spec.engine"}

    # ------------------------------------------------------------------ generation
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = await read_body(request, None)
        contract_error = generate_contract_error(body)
        if contract_error is not None:
            return JSONResponse({"error": contract_error}, status_code=400)
        start = time.perf_counter()
        core = loop.core
        planned, is_single = plan_generate(body, core.tokenizer, core.vocab_size, core.context_length,
                                           args.skip_tokenizer_init)
        futures = [asyncio.wrap_future(loop.generate(EngineRequest(p.rid, p.input_ids, p.params, p.return_logprob)))
                   for p in planned]
        pending = set(futures)
        while pending:  # like SGLang, a client that went away aborts its requests
            _, pending = await asyncio.wait(pending, timeout=1.0)
            if pending and await request.is_disconnected():
                for p in planned:
                    await on_engine(lambda core, rid=p.rid: loop.abort(rid, "client disconnected"))
                return Response(status_code=499)
        outs = await asyncio.gather(*futures, return_exceptions=True)
        errors = [o for o in outs if isinstance(o, BaseException)]
        if errors:
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

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        return await weight_call(weights.begin, await read_body(request, "BeginWeightUpdateReqInput"), True)

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        return await weight_call(weights.end, await read_body(request, "EndWeightUpdateReqInput"), True)

    @app.post("/abort_weight_update")
    async def abort_weight_update(request: Request):
        """slime-spec extension (not in SGLang): roll back and close the open weight-update session."""
        return await weight_call(weights.abort, await read_body(request, "EndWeightUpdateReqInput"), True)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        return await weight_call(weights.init_group, await read_body(request, "InitWeightsUpdateGroupReqInput"),
                                 False)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        return await weight_call(weights.destroy_group,
                                 await read_body(request, "DestroyWeightsUpdateGroupReqInput"), False)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        return await weight_call(weights.update_from_distributed,
                                 await read_body(request, "UpdateWeightsFromDistributedReqInput"), True)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        return await weight_call(weights.update_from_tensor,
                                 await read_body(request, "UpdateWeightsFromTensorReqInput"), True)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        return await weight_call(weights.update_from_disk, await read_body(request, "UpdateWeightFromDiskReqInput"),
                                 True)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        body = await read_body(request, "GetWeightsByNameReqInput")
        out = await on_engine(lambda core: weights.get_weights_by_name(core, body))
        if out is None:
            return error_response("Get parameter by name failed")
        return out

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(request: Request):
        body = await read_body(request, "CheckWeightsReqInput")
        out = await on_engine(lambda core: weights.check_weights(core, body))
        return JSONResponse(out, status_code=200 if out["success"] else 400)

    if args.api_key or args.admin_api_key:
        add_auth(app, args.api_key, args.admin_api_key)
    return app
