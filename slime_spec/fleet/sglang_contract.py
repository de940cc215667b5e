"""SGLang's HTTP request structs, read from the installed wheel's own source.

`sglang.srt.managers.io_struct` cannot be imported on a CPU machine (its import chain
reaches torchvision, which has no CPU build), so we read the class definitions with
`ast` instead. The result is still SGLang's own definition of each payload: a field
added or renamed in the pinned release shows up here without any change of ours.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import threading
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class StructSpec:
    name: str
    fields: dict[str, bool]  # field name -> has a default
    annotations: dict[str, ast.expr] = field(default_factory=dict, compare=False)  # field name -> its type

    @property
    def required(self) -> set[str]:
        return {f for f, has_default in self.fields.items() if not has_default}


def io_struct_path() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sglang is not installed: run `make venv` (or pip install sglang)")
    return Path(list(spec.submodule_search_locations)[0]) / "srt" / "managers" / "io_struct.py"


_PARSE_LOCK = threading.Lock()  # CPython 3.11's ast.parse can fail when two threads parse at once


@functools.cache
def all_structs() -> dict[str, StructSpec]:
    with _PARSE_LOCK:
        tree = ast.parse(io_struct_path().read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def own_fields(node: ast.ClassDef) -> dict[str, tuple[bool, ast.expr]]:
        out: dict[str, tuple[bool, ast.expr]] = {}
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                name = stmt.target.id
                if name.startswith("_") or _is_classvar(stmt.annotation):
                    continue
                out[name] = (stmt.value is not None, stmt.annotation)
        return out

    def fields_of(name: str, seen: frozenset = frozenset()) -> dict[str, tuple[bool, ast.expr]]:
        node = classes.get(name)
        if node is None or name in seen:
            return {}
        merged: dict[str, tuple[bool, ast.expr]] = {}
        for base in node.bases:
            if isinstance(base, ast.Name):
                merged.update(fields_of(base.id, seen | {name}))
        merged.update(own_fields(node))
        return merged

    structs = {}
    for name in classes:
        fields = fields_of(name)
        structs[name] = StructSpec(name, {f: d for f, (d, _) in fields.items()},
                                   {f: a for f, (_, a) in fields.items()})
    return structs


def _is_classvar(annotation: ast.expr) -> bool:
    text = ast.unparse(annotation)
    return text.startswith("ClassVar") or text.startswith("typing.ClassVar")


def struct(name: str) -> StructSpec:
    structs = all_structs()
    if name not in structs:
        raise KeyError(f"io_struct has no class {name!r} in {io_struct_path()}")
    return structs[name]


# Fields every BaseReq carries for SGLang's internal routing; never part of an HTTP body.
_INTERNAL = {"rid", "http_worker_ipc"}


def validate_payload(struct_name: str, payload: dict) -> None:
    """Raise ValueError if `payload` would not build `struct_name` in SGLang."""
    spec = struct(struct_name)
    unknown = set(payload) - set(spec.fields)
    if unknown:
        raise ValueError(
            f"{struct_name} has no field(s) {sorted(unknown)}; known fields: {sorted(spec.fields)}"
        )
    missing = spec.required - set(payload) - _INTERNAL
    if missing:
        raise ValueError(f"{struct_name} is missing required field(s) {sorted(missing)}")
