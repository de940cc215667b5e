"""Which routes take the admin key: the client's ADMIN_ROUTES (fleet/client.py) against the
`@auth_level(AuthLevel.ADMIN_OPTIONAL)` decorators of SGLang 0.5.23's own http_server.py, which the embedded
engine serves unchanged (so its auth levels are SGLang's by construction).

SGLang's app cannot be imported here (it installs uvloop's event-loop policy at import), so its routes and
their auth levels are read from its source with `ast`: the decorators are the declaration, nothing runs.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from slime_spec.fleet.client import ADMIN_ROUTES

ROUTE_DECORATORS = {"get", "post", "put", "api_route"}


def route_auth_levels(source: str) -> dict[str, str]:
    """path -> auth level ("NORMAL" when undecorated) for every `@app.<get|post|put|api_route>(path)` function."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls = [d for d in node.decorator_list if isinstance(d, ast.Call)]
        paths = [c.args[0].value for c in calls if isinstance(c.func, ast.Attribute)
                 and c.func.attr in ROUTE_DECORATORS and c.args and isinstance(c.args[0], ast.Constant)]
        levels = [c.args[0].attr for c in calls if isinstance(c.func, ast.Name) and c.func.id == "auth_level"]
        out.update({path: levels[0] if levels else "NORMAL" for path in paths})
    return out


def sglang_routes() -> dict[str, str]:
    spec = importlib.util.find_spec("sglang")
    return route_auth_levels((Path(spec.origin).parent / "srt" / "entrypoints" / "http_server.py").read_text())


def test_the_source_reader_finds_sglangs_routes():
    routes = sglang_routes()
    assert routes["/generate"] == "NORMAL" and routes["/update_weights_from_disk"] == "ADMIN_OPTIONAL"
    assert len(routes) > 40


def test_the_clients_admin_routes_are_sglangs():
    """Every route SGLang marks ADMIN_OPTIONAL gets the admin key from the client, and no NORMAL route does (a
    route SGLang lacks, e.g. /abort_weight_update of earlier embedded engines, may stay listed: it is never served
    by SGLang's app)."""
    sglang = sglang_routes()
    admin = {p for p, level in sglang.items() if level == "ADMIN_OPTIONAL"}
    used = {"/flush_cache", "/abort_request", "/pause_generation", "/continue_generation", "/update_weight_version",
            "/begin_weight_update", "/end_weight_update", "/update_weights_from_distributed",
            "/update_weights_from_tensor", "/init_weights_update_group", "/destroy_weights_update_group",
            "/weights_checker", "/release_memory_occupation", "/resume_memory_occupation"}
    assert used <= admin, used - admin  # the routes the project calls
    assert ADMIN_ROUTES & set(sglang) <= admin, (ADMIN_ROUTES & set(sglang)) - admin
    assert used <= ADMIN_ROUTES
