"""The import layers of slime_spec, as docs/en/architecture.md draws them, checked against the code.

Every import statement counts, at module level or inside a function (a function-level import is a dependency
that runs later, not a lesser one). Imports under `if TYPE_CHECKING:` run never: they count for the layers, not
for cycles.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIR = REPO / "slime_spec"
DOCS = (REPO / "docs" / "en" / "architecture.md", REPO / "docs" / "zh" / "architecture.md")
ROOT = "slime_spec"

# Top to bottom: a module imports modules of its own layer and of layers below it, never of one above.
# An entry names a module or a package (all of it); the longest entry that covers a module places it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("demo", ("slime_spec.demo",)),
    ("driver", ("slime_spec.driver", "slime_spec.train", "slime_spec.cli", "slime_spec.doctor", "slime_spec.tools",
                "slime_spec.speculative.speedup")),
    ("trainer", ("slime_spec.trainer",)),
    ("rollout", ("slime_spec.rollout",)),
    ("weight_sync", ("slime_spec.weight_sync",)),
    ("fleet", ("slime_spec.fleet",)),
    ("cluster", ("slime_spec.cluster",)),
    ("engine", ("slime_spec.engine",)),
    # what slime-spec knows of SGLang itself: its parameter layout, its meta_info counters, importing it on CPU
    ("sglang", ("slime_spec.speculative.stats", "slime_spec.engine.sglang_stand_ins",
                "slime_spec.weight_sync.verify.sglang_params", "slime_spec.weight_sync.fp8")),
    ("config", ("slime_spec.config", "slime_spec.speculative", "slime_spec.doctor.codes")),
    ("common", (ROOT, "slime_spec.common")),
)

# The embedded engine is another process, reached over HTTP: of the layers above it only the driver imports it
# (the doctor checks the engine's flags with engine/server_args.py).
IMPORTED_ONLY_BY = {"engine": ("driver",)}

# Third-party packages a layer never imports.
NEVER_IMPORTS = {
    "engine": ("ray", "megatron"),
    "sglang": ("ray", "megatron"),
    "config": ("ray", "megatron"),
    "common": ("ray", "megatron"),
    "rollout": ("megatron",),
}

# Third-party packages only these layers import: engines are reached through fleet/client.py alone.
ONLY_IMPORTED_IN = {"requests": ("fleet",), "aiohttp": ("fleet",)}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a slime_spec module, or a third-party top-level package
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`

    def where(self) -> str:
        return f"{self.importer} (line {self.line}) -> {self.target}"


def module_names(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__.py)."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The imports in one module's source, slime_spec ones resolved to the module they load."""
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` loads the module pkg.sub; `from mod import name` loads mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            if target == ROOT or target.startswith(ROOT + "."):
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
            else:
                target = target.partition(".")[0]
            if target != name:
                found.append(Import(name, target, node.lineno, node.lineno in type_only))
    return found


def import_graph(package_dir: Path = PACKAGE_DIR) -> list[Import]:
    modules = module_names(package_dir)
    return [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]


def layer_of(module: str, layers=LAYERS) -> str | None:
    best, best_len = None, -1
    for layer, entries in layers:
        for entry in entries:
            covers = module == entry or (entry != ROOT and module.startswith(entry + "."))
            if covers and len(entry) > best_len:
                best, best_len = layer, len(entry)
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_violations(graph: list[Import], layers=LAYERS, imported_only_by=IMPORTED_ONLY_BY,
                     never_imports=NEVER_IMPORTS, only_imported_in=ONLY_IMPORTED_IN) -> list[str]:
    rank = {layer: i for i, (layer, _) in enumerate(layers)}  # 0 is the top
    problems = []
    for imp in graph:
        source = layer_of(imp.importer, layers)
        if not imp.target.startswith(ROOT):
            if imp.target in never_imports.get(source, ()):
                problems.append(f"{imp.where()}: the {source} layer never imports {imp.target}")
            elif imp.target in only_imported_in and source not in only_imported_in[imp.target]:
                problems.append(f"{imp.where()}: only {only_imported_in[imp.target]} import {imp.target}")
            continue
        target = layer_of(imp.target, layers)
        if source is None or target is None or source == target:
            continue
        if rank[target] < rank[source]:
            problems.append(f"{imp.where()}: the {source} layer imports the {target} layer above it")
        elif target in imported_only_by and source not in imported_only_by[target]:
            problems.append(f"{imp.where()}: only {imported_only_by[target]} import the {target} layer")
    return problems


def documented_layers(markdown: str) -> list[tuple[str, set[str]]]:
    """The layer picture of architecture.md (the code block after the heading that names import layers): each
    line that starts with a layer name, and its continuation lines, list files (`x.py`) and packages (`x/`) under
    slime_spec/; a note in parentheses is not part of the list."""
    block = re.search(r"^## [^\n]*(Import layers|导入分层)[^\n]*\n.*?```\n(.*?)```", markdown, re.S | re.M)
    assert block, "architecture.md has no layer picture (a code block under the 'Import layers' heading)"
    layers: list[tuple[str, set[str]]] = []
    for line in block.group(2).splitlines():
        head, rest = (line.split(None, 1) + [""])[:2] if not line.startswith(" ") else ("", line)
        if head:
            layers.append((head, set()))
        for token in re.findall(r"[\w/]+(?:\.py|/)", re.sub(r"\(.*?\)", "", rest)):
            layers[-1][1].add(".".join([ROOT, *token.removesuffix(".py").strip("/").split("/")]))
    return layers


# ---- the checks on slime_spec ----

@pytest.fixture(scope="module")
def graph() -> list[Import]:
    return import_graph()


def test_every_module_has_a_layer():
    unplaced = [m for m in module_names() if layer_of(m) is None]
    assert not unplaced, (f"modules in no layer: {unplaced}; add each to LAYERS in this file and to the layer "
                          "picture in docs/en/architecture.md (and docs/zh/architecture.md)")


def test_every_layer_entry_names_a_module():
    modules = module_names()
    stale = [e for _, entries in LAYERS for e in entries if e not in modules]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.parent.name)
def test_the_architecture_docs_draw_these_layers(doc):
    want = [(layer, set(entries) - {ROOT}) for layer, entries in LAYERS]
    assert documented_layers(doc.read_text()) == want, (
        f"{doc.relative_to(REPO)}'s layer picture differs from LAYERS in this file: change both together")


def test_no_import_cycles(graph):
    edges: dict[str, set[str]] = {}
    for imp in graph:
        if imp.target.startswith(ROOT) and not imp.type_only:
            edges.setdefault(imp.importer, set()).add(imp.target)
    found = cycles(edges)
    where = [[i.where() for i in graph if i.importer in c and i.target in c] for c in found]
    assert not found, f"import cycles (move what both sides share into the lower module or a new one): {where}"


def test_imports_follow_the_layers(graph):
    problems = layer_violations(graph)
    assert not problems, "\n".join(problems)


# ---- the checker itself ----

def test_checker_finds_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / ROOT
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from slime_spec.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from slime_spec import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from slime_spec.a import x\n")
    graph = import_graph(pkg)
    assert {(i.importer, i.target, i.type_only) for i in graph} == {
        ("slime_spec.a", "slime_spec.b", False), ("slime_spec.b", "slime_spec.a", False),
        ("slime_spec.c", "typing", False), ("slime_spec.c", "slime_spec.a", True)}
    edges = {"slime_spec.a": {"slime_spec.b"}, "slime_spec.b": {"slime_spec.a"}, "slime_spec.c": {"slime_spec.a"}}
    assert cycles(edges) == [["slime_spec.a", "slime_spec.b"]]
    assert cycles({"x": {"y"}, "y": {"z"}}) == []


def test_checker_finds_an_upward_import_and_a_forbidden_one():
    layers = (("top", ("slime_spec.top",)), ("mid", ("slime_spec.mid",)), ("low", ("slime_spec.low",)))
    graph = [Import("slime_spec.low.x", "slime_spec.top.y", 3, False),
             Import("slime_spec.mid.x", "slime_spec.low.y", 4, False),
             Import("slime_spec.mid.x", "ray", 5, False),
             Import("slime_spec.top.x", "slime_spec.mid.y", 6, False),
             Import("slime_spec.top.x", "requests", 7, False),
             Import("slime_spec.low.x", "requests", 8, False)]
    problems = layer_violations(graph, layers, imported_only_by={"mid": ()}, never_imports={"mid": ("ray",)},
                                only_imported_in={"requests": ("low",)})
    assert problems == ["slime_spec.low.x (line 3) -> slime_spec.top.y: the low layer imports the top layer above it",
                        "slime_spec.mid.x (line 5) -> ray: the mid layer never imports ray",
                        "slime_spec.top.x (line 6) -> slime_spec.mid.y: only () import the mid layer",
                        "slime_spec.top.x (line 7) -> requests: only ('low',) import requests"]
    assert layer_of("slime_spec.top.deep.module", layers) == "top"
    assert layer_of("slime_spec.topmost", layers) is None


def test_layer_picture_is_read_file_by_file_and_notes_are_skipped():
    markdown = ("# A\n\n## Import layers\n\ntext\n\n```\ntop     a.py, pkg/\n        b.py    (but pkg/c.py: low)\n"
                "low     pkg/c.py\n```\n\n```\nother  x.py\n```\n")
    assert documented_layers(markdown) == [("top", {"slime_spec.a", "slime_spec.pkg", "slime_spec.b"}),
                                           ("low", {"slime_spec.pkg.c"})]
