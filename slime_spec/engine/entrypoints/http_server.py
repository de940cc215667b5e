"""What the embedded engine adds to SGLang's own HTTP app (`sglang.srt.entrypoints.http_server.app`).

Every SGLang route, status and body is SGLang's. The additions, both slime-spec extensions:
- the `/generate` field `slime_history` (history drafting: which group and corpus a request drafts from).
  SGLang's GenerateReqInput has no such field, so a pure ASGI middleware takes it out of the body before SGLang
  parses it and carries it in `extra_key` (io_struct.history_extra_key), which SGLang forwards to the scheduler.
  A body that carries no `slime_history` passes through untouched (the middleware only looks for the field's
  name in the raw bytes);
- `POST /abort_weight_update {}`: roll back and close the open weight-update session (the syncer calls it on
  every engine when one engine's update failed). It travels through SGLang's own end-of-session path (its
  TokenizerManager's weight-update lock and communicator) as an `EndWeightUpdateReqInput` whose rid is
  `ABORT_SESSION_RID`; the scheduler's reply `success` says whether a session was rolled back. The rollback
  restores the weight version too: the scheduler names it after `RESTORED_VERSION_TAG` in its message, and the
  route relabels the front end through SGLang's own `TokenizerManager.update_weight_version` (a session's last
  update may have labelled the weights it rolled back). Admin level, as SGLang's session routes.
"""

from __future__ import annotations

import json

from slime_spec.engine.managers.io_struct import HISTORY_FIELD, history_extra_key

GENERATE_PATHS = frozenset({"/generate"})
ABORT_SESSION_RID = "slime_spec:abort_weight_update"  # an EndWeightUpdateReqInput with this rid rolls back
RESTORED_VERSION_TAG = "slime_spec_restored_weight_version="  # then a JSON string: the version serving again


def tag_restored_version(message: str, version: str) -> str:
    """A rollback's reply message naming the weight version that serves again (SGLang's reply struct has only
    success and message)."""
    return f"{message} {RESTORED_VERSION_TAG}{json.dumps(version)}"


def restored_version(message: str) -> str | None:
    """The version `tag_restored_version` put in `message`; None where there is none."""
    at = message.find(RESTORED_VERSION_TAG)
    if at < 0:
        return None
    version, _ = json.JSONDecoder().raw_decode(message, at + len(RESTORED_VERSION_TAG))
    return version if isinstance(version, str) else None


def _error(message: str) -> tuple[int, bytes]:
    return 400, json.dumps({"error": {"message": message}}).encode()


def rewrite_generate_body(raw: bytes) -> tuple[bytes, tuple[int, bytes] | None]:
    """(the body SGLang should see, or an error (status, body) to answer instead)."""
    if HISTORY_FIELD.encode() not in raw:
        return raw, None
    try:
        body = json.loads(raw)
    except ValueError:
        return raw, None  # SGLang answers the malformed body itself
    if not isinstance(body, dict) or HISTORY_FIELD not in body:
        return raw, None
    ext = body.pop(HISTORY_FIELD)
    if ext is None:
        return json.dumps(body).encode(), None
    try:
        key = history_extra_key(ext)
    except ValueError as e:
        return raw, _error(str(e))
    batch = isinstance(body.get("text"), list) or (isinstance(body.get("input_ids"), list) and body["input_ids"]
                                                   and isinstance(body["input_ids"][0], list))
    if batch:
        return raw, _error(f"{HISTORY_FIELD} applies to one prompt: send it with a single text / input_ids (use "
                           "sampling_params.n for a group)")
    if body.get("extra_key"):
        return raw, _error(f"{HISTORY_FIELD} travels in extra_key on the embedded engine: send one of them")
    body["extra_key"] = key
    return json.dumps(body).encode(), None


class HistoryExtension:
    """Pure ASGI middleware: `slime_history` out of a /generate body, into `extra_key` (see the module docstring)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in GENERATE_PATHS:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                await self.app(scope, _replay([message]), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body, error = rewrite_generate_body(b"".join(chunks))
        if error is not None:
            status, payload = error
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.app({**scope, "headers": headers}, _replay([{"type": "http.request", "body": body}], receive),
                       send)


def _replay(messages: list[dict], then=None):
    pending = list(messages)

    async def receive():
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()  # e.g. http.disconnect, which SGLang watches to abort a request
        return {"type": "http.disconnect"}
    return receive


async def abort_weight_update():
    from fastapi.responses import JSONResponse
    from sglang.srt.entrypoints.http_server import _global_state
    from sglang.srt.managers.io_struct import EndWeightUpdateReqInput, UpdateWeightVersionReqInput

    manager = _global_state.tokenizer_manager
    rolled_back, message = await manager.end_weight_update(EndWeightUpdateReqInput(rid=ABORT_SESSION_RID))
    version = restored_version(message) if rolled_back else None
    if version is not None:
        await manager.update_weight_version(UpdateWeightVersionReqInput(new_version=version,
                                                                        abort_all_requests=False))
    return JSONResponse({"success": True, "message": message, "rolled_back": rolled_back})


def install_extensions(app) -> None:
    """Add the embedded engine's additions to SGLang's app (before the server starts)."""
    from sglang.srt.utils.auth import AuthLevel, auth_level

    app.add_middleware(HistoryExtension)
    app.post("/abort_weight_update")(auth_level(AuthLevel.ADMIN_OPTIONAL)(abort_weight_update))
