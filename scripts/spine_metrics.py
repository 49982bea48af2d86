"""Measure the structure of the core against the goals of issue #27 ("One spine").

Four figures, printed as a table (``--json`` prints one JSON object instead):

``circles``
    The core's static import graph (``import``/``from ... import`` statements anywhere in a
    module: at module level and inside functions alike; imports under ``if TYPE_CHECKING:``
    are left out, they never run) and its strongly connected components of more than one
    module: the import circles, with their files. ``importlib.import_module("kernelattn_core.x")``
    with a literal name counts as an import too. An edge goes from a module to every
    project module it names: ``from .pkg import name`` names ``pkg.name`` when ``name`` is a
    submodule, else ``pkg`` (its ``__init__``, where ``name`` is defined). Goal: 0.

``upward``
    Imports "running back up": each module belongs to one layer of :data:`LAYERS` (lowest
    first); an import from a module to a module of a higher layer counts once per
    (importer, imported) pair. Goal: <= 1. An old module path kept for users (listed in
    :data:`ALIASES`: a module that only replaces itself in ``sys.modules`` by its new home)
    is not counted: nothing in the core imports it (``tests/test_architecture.py`` checks
    that, and that it imports nothing but its new home); the table lists them.

``trace``
    One ``kernel_attention(q, k, v, create("prf"), causal=True)`` forward (and forward +
    backward), after a warm-up call, traced with :func:`sys.setprofile`: the project files
    entered (core, plugins), the project calls, and the *layer path*: the layers of the
    files in the order they are first entered, consecutive repeats merged. Layer moves are
    the steps of that path, moves back up the steps to a higher layer. Plugins count as the
    ``registry/builtins`` layer (they are registered implementations like the built-ins).
    Goal (forward): <= 6 files and <= 3 layer moves.

``plugin_imports``
    Imports of ``kernelattn_core`` in ``plugins/*/`` and ``docs/tutorial/kernelattn-example``
    (sources and tests): all of them, those outside the published surface (the top-level
    package ``kernelattn_core`` and ``kernelattn_core.toolkit``), and among those the ones
    that reach core internals (private names, ``lookup``, ``registry``, ``engine``, ``cli``,
    ``builtins``, ``interfaces``'s submodules). Goal: 0 outside the toolkit.

Run ``python scripts/spine_metrics.py`` (``--no-trace`` skips the traced call, which needs
torch and the installed plugins).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "kernelattn_core"
PACKAGE = "kernelattn_core"

#: layers of the core, lowest first: a module belongs to the first layer with a prefix of its
#: dotted name (relative to ``kernelattn_core``; ``""`` is the package's ``__init__``)
LAYERS: dict[str, tuple[str, ...]] = {
    # report/ (tables, plots, progress, timing; formerly in cli/) imports nothing of the core
    # above errors.py, and the library below the CLI (experiments, verify, tasks, convert)
    # shows its results with it: it belongs at the bottom, beside the errors
    "base": ("errors", "validation", "hookspecs", "experiments", "report"),
    "interfaces": ("interfaces", "redraw", "claims"),
    "engine": ("engine",),
    "registry/builtins": ("registry", "lookup", "builtins", "plugins"),
    "api/module": ("api", "module", "distributed", "testing", "verify", ""),
    "convert/tasks/workloads": ("convert", "tasks", "workloads"),
    "cli": ("cli",),
    # the published plugin toolkit re-exports names from every layer (the report helpers
    # included) and nothing in the core imports it: a leaf facade on top
    "toolkit": ("toolkit",),
}

#: old module paths kept for users and plugins of the published docs (relative to
#: ``kernelattn_core``) -> the module each one stands for now (issue 27). Each is a module
#: whose body is ``sys.modules[__name__] = import_module(<new home>)``: importing the old
#: path gives the new module itself. Their one import (up, for ``engine.*``) is not counted.
ALIASES: dict[str, str] = {
    "engine.api": "api",  # kernel_attention beside create (deprecated: warns)
    "engine.distributed": "distributed",  # sequence-parallel attention, a client of the estimators
    "claims.targets": "verify.targets",  # measured_targets builds estimators from names
}

#: what a plugin may import: the top-level API and the published toolkit
PUBLISHED = {PACKAGE, f"{PACKAGE}.toolkit"}
#: module prefixes that are core internals (counted separately among the unpublished imports)
INTERNAL = ("lookup", "registry", "engine", "cli", "builtins", "interfaces.")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def core_modules(core: Path = CORE) -> dict[str, Path]:
    return {module_name(p, core.parent): p for p in sorted(core.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skip.update(id(n) for n in ast.walk(child))
    return skip


def imported_names(source: str, module: str, is_package: bool) -> list[tuple[str, list[str], int]]:
    """``(absolute module, imported names, line)`` of every import in ``source`` (``module``
    is the importing module's dotted name), imports under ``TYPE_CHECKING`` left out."""
    tree = ast.parse(source)
    skip = _type_checking_nodes(tree)
    out = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            out.append((target, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            first = node.args[0]
            if called == "import_module" and isinstance(first, ast.Constant) and isinstance(first.value, str):
                if not first.value.startswith("."):  # a literal absolute name: an import like any other
                    out.append((first.value, [], node.lineno))
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for target, names, _ in imported_names(path.read_text(), mod, path.name == "__init__.py"):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            if target in modules and (not names or len(subs) < len(names)):
                graph[mod].add(target)  # a name defined in the package's __init__ (or a plain import)
            graph[mod].update(subs)
        graph[mod].discard(mod)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); components of more than one node, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out, key=lambda c: (-len(c), c))


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of a dotted core module name (``kernelattn_core.x.y``)."""
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        raise KeyError(f"module {module!r} is not in {PACKAGE}")
    rel = module[len(PACKAGE) + 1 :]
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS.values()):
        for p in prefixes:
            match = rel == p or (p and rel.startswith(p + ".")) or (p == "" and rel == "")
            if match and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise KeyError(f"module {module!r} is in no layer of LAYERS")
    return best


def _alias_edge(a: str, b: str) -> bool:
    """Whether ``a -> b`` is an old path (:data:`ALIASES`) resolving to its new home."""
    rel = a[len(PACKAGE) + 1 :]
    return rel in ALIASES and b == f"{PACKAGE}.{ALIASES[rel]}"


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted(
        (a, b) for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a) and not _alias_edge(a, b)
    )


def classify_imports(source: str, label: str) -> list[dict[str, object]]:
    """Every import of ``kernelattn_core`` in one plugin source (``label`` names it),
    classified: ``published`` (the top level or the toolkit, no private name) and
    ``internal`` (reaching core internals, see the module doc)."""
    out = []
    for target, names, line in imported_names(source, "plugin", False):
        if target != PACKAGE and not target.startswith(PACKAGE + "."):
            continue
        rel = target[len(PACKAGE) + 1 :]
        published = target in PUBLISHED
        private = [n for n in names if n.startswith("_")]
        internal = not published and any(rel == p or rel.startswith(p) for p in INTERNAL)
        out.append(
            {
                "file": label,
                "line": line,
                "module": target,
                "names": names,
                "published": published and not private,
                "internal": internal or bool(private),
            }
        )
    return out


def plugin_import_lines(paths: Iterable[Path]) -> list[dict[str, object]]:
    """Every import of ``kernelattn_core`` in the given plugin files, classified."""
    return [i for path in paths for i in classify_imports(path.read_text(), str(path.relative_to(ROOT)))]


def plugin_files(root: Path = ROOT) -> list[Path]:
    files = sorted((root / "plugins").glob("*/**/*.py"))
    files += sorted((root / "docs" / "tutorial" / "kernelattn-example").rglob("*.py"))
    return files


def trace_prf(backward: bool) -> dict[str, object]:
    """Files, calls and layer path of one traced causal ``prf`` call (see the module doc)."""
    import torch

    import kernelattn_core as ka

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=backward) for _ in range(3))
    est = ka.create("prf", num_features=32, seed=0)
    out = ka.kernel_attention(q, k, v, est, causal=True)  # warm-up: lazy imports, caches
    if backward:
        out.sum().backward()
    roots = {str(CORE), str(ROOT / "plugins")}
    calls: list[str] = []

    def in_project(filename: str) -> bool:
        return any(filename.startswith(r) for r in roots)

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "call" and in_project(frame.f_code.co_filename):
            calls.append(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        out = ka.kernel_attention(q, k, v, est, causal=True)
        if backward:
            # autograd calls the Functions' backward from C++ on this thread
            out.sum().backward()
    finally:
        sys.setprofile(None)
    files: list[str] = []
    for f in calls:
        if f not in files:
            files.append(f)
    path: list[int] = []
    for f in files:
        layer = file_layer(Path(f))
        if not path or path[-1] != layer:
            path.append(layer)
    names = list(LAYERS)
    return {
        "files": len(files),
        "calls": len(calls),
        "file_list": [str(Path(f).relative_to(ROOT)) for f in files],
        "layer_path": [names[i] for i in path],
        "layer_moves": max(len(path) - 1, 0),
        "moves_up": sum(1 for a, b in itertools.pairwise(path) if b > a),
    }


def file_layer(path: Path) -> int:
    path = path.resolve()
    if path.is_relative_to(ROOT / "plugins"):
        return list(LAYERS).index("registry/builtins")
    return layer_of(module_name(path))


def measure(trace: bool = True) -> dict[str, object]:
    modules = core_modules()
    graph = import_graph(modules)
    circles = strongly_connected(graph)
    upward = upward_imports(graph)
    imports = plugin_import_lines(plugin_files())
    result: dict[str, object] = {
        "modules": len(modules),
        "import_edges": sum(len(t) for t in graph.values()),
        "circles": [[str(modules[m].relative_to(ROOT)) for m in comp] for comp in circles],
        "circle_files": sum(len(c) for c in circles),
        "upward": [f"{a} -> {b}" for a, b in upward],
        "aliases": [f"{PACKAGE}.{old} -> {PACKAGE}.{new}" for old, new in ALIASES.items()],
        "plugin_imports": len(imports),
        "plugin_imports_unpublished": [f"{i['file']}:{i['line']} {i['module']}" for i in imports if not i["published"]],
        "plugin_imports_internal": [
            f"{i['file']}:{i['line']} {i['module']} {i['names']}" for i in imports if i["internal"]
        ],
    }
    if trace:
        result["forward"] = trace_prf(backward=False)
        result["forward_backward"] = trace_prf(backward=True)
    return result


def table(result: dict[str, object]) -> str:
    rows = [
        ("import circles (SCCs > 1 module)", len(result["circles"]), "0"),
        ("files in circles", result["circle_files"], "0"),
        ("imports running back up", len(result["upward"]), "<= 1"),
        ("  old paths kept (aliases, not counted)", len(result["aliases"]), ""),
    ]
    for key, label in (("forward", "prf causal forward"), ("forward_backward", "prf causal forward+backward")):
        if key in result:
            t = result[key]
            rows += [
                (f"{label}: project files", t["files"], "<= 6" if key == "forward" else ""),
                (f"{label}: project calls", t["calls"], ""),
                (f"{label}: layer moves", t["layer_moves"], "<= 3" if key == "forward" else ""),
                (f"{label}: moves back up", t["moves_up"], ""),
            ]
    rows += [
        ("plugin imports of kernelattn_core", result["plugin_imports"], ""),
        ("  outside the toolkit/top level", len(result["plugin_imports_unpublished"]), "0"),
        ("  reaching core internals", len(result["plugin_imports_internal"]), "0"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'figure':<{width}}  {'value':>6}  goal", "-" * (width + 16)]
    lines += [f"{name:<{width}}  {value:>6}  {goal}" for name, value, goal in rows]
    for comp in result["circles"]:
        lines.append(f"circle ({len(comp)} files): " + ", ".join(comp))
    for edge in result["upward"]:
        lines.append(f"up: {edge}")
    for edge in result["aliases"]:
        lines.append(f"alias: {edge}")
    if "forward" in result:
        lines.append("forward layer path: " + " -> ".join(result["forward"]["layer_path"]))
        lines.append("forward files: " + ", ".join(result["forward"]["file_list"]))
    for item in result["plugin_imports_internal"]:
        lines.append(f"internal: {item}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-trace", action="store_true", help="skip the traced prf call (no torch needed)")
    args = parser.parse_args(argv)
    result = measure(trace=not args.no_trace)
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
