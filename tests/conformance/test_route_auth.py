"""Which routes take the admin key: our embedded server's ADMIN_OPTIONAL_PATHS against the
`@auth_level(AuthLevel.ADMIN_OPTIONAL)` decorators of SGLang 0.5.23's own http_server.py.

SGLang's app cannot be imported here (it installs uvloop's event-loop policy at import), so its routes and
their auth levels are read from its source with `ast`: the decorators are the declaration, nothing runs.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from slime_spec.engine import http_server

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


def test_our_admin_routes_are_sglangs():
    sglang = sglang_routes()
    ours = route_auth_levels(Path(http_server.__file__).read_text())
    shared = set(ours) & set(sglang)
    assert {"/freeze_gc", "/flush_cache", "/generate"} <= shared
    want = {p for p in shared if sglang[p] == "ADMIN_OPTIONAL"}
    assert want == http_server.ADMIN_OPTIONAL_PATHS & shared
