"""The package's import graph is layered: no cycle, and no import reaches up a layer.

Every import counts — module level, inside a function, under ``if TYPE_CHECKING``, and
``importlib.import_module("literal")`` — because a function-level import is still a
dependency: hiding one inside a function moves the cycle to run time, it does not remove it.
Importing ``a.b.c`` also counts as importing the package ``a.b``, whose ``__init__`` runs
first. The graph is read from the source with ``ast``; nothing is imported. Not seen:
imports of computed names (``protocols``' lazy exports, the custom-backend registry in
``models/hf/backend.py``), which today stay inside one layer.
"""

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "hyper_parallel"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Lowest first. A module belongs to the layer of its longest matching prefix (relative to
# the package); an import may reach its own layer or a lower one, never a higher one.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("", "class_paths", "console_log", "digest", "errors", "hf_config_keys"),  # the package root and leaf
                                            # modules: stdlib only
    ("platform",),                          # torch backend indirection (platform.Module/Linear): torch only
    ("protocols",),                         # Module (on platform.Module) / Config / ShardingConfig / placements
    ("config",),                            # the recipe: dataclasses, YAML loading, launch check; its
                                            # plan_overrides are written in the plan's own placement text
    ("distributed",),                       # what runs in training: mesh, the plan applier, collectives
    ("models.common", "components"),        # building blocks and their declarative sharding
    ("runtime", "launch"),                  # what a training process needs of a bundle (generated files import
                                            # it); starting ranks under torchrun and hearing from each
    ("planning",),                          # build-time planning: the planner, dataflow, dry runs, lints
    ("codegen",),                           # the pipeline: the build tool
    ("models.hf", "models.qwen3_moe", "models"),  # model builders: hf / custom / gen backends
    ("trainer",),                           # training on a built model
    ("testing",),                           # what the tests and the benches share (tiny families, one case)
)

# The layers the issue names as "lower": none of them may import any "higher" one.
LOWER = ("config", "protocols", "platform", "distributed")
HIGHER = ("runtime", "launch", "planning", "codegen", "models", "trainer", "components")

# Imports the layer order allows but the design does not: the trainer reaches codegen
# only through the model builders (HyperAutoModel), never its internals.
FORBIDDEN = (("trainer", "codegen"),)

# The one door from the training side up to the build tool: its functions import codegen
# when a bundle must be built (or a recipe projected, or a model without a bundle
# planned), never at module level. Its edges up are the one sanctioned exception to the
# layer order; the tests below hold it to that.
DOOR = f"{PACKAGE}.runtime.build"


@dataclass(frozen=True)
class Edge:
    """One import: who imports what, and where, so a failure names the line to change."""
    source: str
    target: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT.parent)}:{self.line}"

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}  ({self.where()})"


def _module_name(path: Path) -> str:
    """The dotted name Python gives the file (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _imported_names(tree: ast.AST, module: str, is_package: bool):
    """(dotted name, line) for every import in the tree, wherever it sits; ``from x import
    y`` yields ``x.y`` (a submodule, when it is one) as well as ``x``, which the caller
    narrows to the modules that exist. Relative imports are resolved against ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base, node.lineno, tuple(alias.name for alias in node.names)
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield first.value, node.lineno, ()


def _is_import_module(func: ast.expr) -> bool:
    """``importlib.import_module(...)`` or a bare ``import_module(...)``."""
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id == "import_module"


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module ``name`` denotes: itself, or its longest existing prefix (``import
    a.b.C`` style names never happen, but ``from a.b import C`` hands us ``a.b``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _packages_run_first(source: str, target: str, modules: dict[str, Path]) -> set[str]:
    """The packages whose ``__init__`` importing ``target`` runs before it (``a.b`` for
    ``a.b.c``), less the package root and ``source``'s own packages, which are already
    being imported when ``source`` runs."""
    own = {source.rsplit(".", depth)[0] for depth in range(source.count(".") + 1)}
    parts = target.split(".")
    return {name for name in (".".join(parts[:i]) for i in range(2, len(parts)))
            if name in modules and name not in own}


@functools.cache
def module_edges() -> tuple[Edge, ...]:
    """Every import from a package module to another package module (read once per run),
    with the packages each import runs on the way."""
    modules = _modules()
    edges = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name, line, fromlist in _imported_names(tree, module, path.name == "__init__.py"):
            if not (name == PACKAGE or name.startswith(PACKAGE + ".")):
                continue
            targets = {_resolve(f"{name}.{item}", modules) for item in fromlist} or {_resolve(name, modules)}
            targets = {t for t in targets if t}
            targets |= {package for t in targets for package in _packages_run_first(module, t, modules)}
            for target in sorted(targets - {module}):
                edges.append(Edge(module, target, path, line))
    return tuple(edges)


def _through_the_door(edge: Edge) -> bool:
    return edge.source == DOOR and _top(edge.target) == "codegen"


@functools.cache
def layered_edges() -> tuple[Edge, ...]:
    """Every edge but the door's calls up into codegen, which are late-bound by contract."""
    return tuple(edge for edge in module_edges() if not _through_the_door(edge))


def subpackage(module: str) -> str:
    """``hyper_parallel.<first component>``: the granularity the layering talks about."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _relative(module: str) -> str:
    """The module's name inside the package ("" for the package itself)."""
    return module[len(PACKAGE) + 1:]


def _layer(module: str) -> int:
    """The index in LAYERS of the module's longest matching prefix."""
    relative = _relative(module)
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = relative == prefix or (prefix and relative.startswith(prefix + "."))
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add its prefix to LAYERS in {__file__}"
    return best


def _cycles(graph: dict[str, dict[str, Edge]]) -> list[list[Edge]]:
    """One cycle per strongly connected component of more than one node (Tarjan's
    algorithm, iterative), each as the edges that close it, so every cycle is named."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
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
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, dict[str, Edge]], component: set[str]) -> list[Edge]:
    """A shortest cycle through the component's smallest node (breadth-first search)."""
    start = min(component)
    parents: dict[str, tuple[str, Edge]] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child, edge in sorted(graph[node].items()):
                if child not in component:
                    continue
                if child == start:
                    path, step = [edge], node
                    while step != start:
                        step, before = parents[step]
                        path.insert(0, before)
                    return path
                if child not in parents:
                    parents[child] = (node, edge)
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def _graph(edges: tuple[Edge, ...], key=lambda module: module) -> dict[str, dict[str, Edge]]:
    """Adjacency by ``key`` (module or subpackage), keeping the first edge seen as the witness."""
    graph: dict[str, dict[str, Edge]] = {}
    for edge in edges:
        source, target = key(edge.source), key(edge.target)
        graph.setdefault(target, {})
        if source != target:
            graph.setdefault(source, {}).setdefault(target, edge)
    return graph


def _describe(cycles: list[list[Edge]], key=lambda module: module) -> str:
    """Each cycle as its path, then the import line behind every step."""
    lines = []
    for cycle in cycles:
        lines.append(" -> ".join([key(cycle[0].source), *(key(edge.target) for edge in cycle)]))
        lines.extend(f"    {edge}" for edge in cycle)
    return "\n".join(lines)


def test_the_graph_is_read():
    """Guards the readers: a known import of each kind is found."""
    edges = {(edge.source, edge.target) for edge in module_edges()}
    assert len(_modules()) > 50
    assert ("hyper_parallel.codegen.__main__", "hyper_parallel.codegen.cli") in edges


def test_the_readers_see_every_kind_of_import():
    """Function-level, relative and ``importlib.import_module`` imports all count."""
    source = (
        "import importlib\n"
        "from . import sibling\n"
        "from ..config import schema\n"
        "def f():\n"
        "    from hyper_parallel.codegen import spec\n"
        "    importlib.import_module('hyper_parallel.trainer.base')\n"
    )
    found = {name for name, _, _ in _imported_names(ast.parse(source), "hyper_parallel.distributed.x", False)}
    assert {"hyper_parallel.distributed", "hyper_parallel.config", "hyper_parallel.codegen",
            "hyper_parallel.trainer.base"} <= found


def test_a_cycle_is_named_with_its_import_lines():
    """Guards the checker: a cycle found in a made-up graph is printed step by step, with
    the file and line of each import, and an acyclic graph passes."""
    path = ROOT / "x.py"
    edges = (Edge("p.a", "p.b", path, 1), Edge("p.b", "p.c", path, 2), Edge("p.c", "p.a", path, 3),
             Edge("p.c", "p.d", path, 4))
    cycles = _cycles(_graph(edges))
    assert [[(e.source, e.target) for e in cycle] for cycle in cycles] == [[("p.a", "p.b"), ("p.b", "p.c"),
                                                                            ("p.c", "p.a")]]
    assert _describe(cycles).splitlines() == [
        "p.a -> p.b -> p.c -> p.a",
        f"    p.a -> p.b  ({PACKAGE}/x.py:1)", f"    p.b -> p.c  ({PACKAGE}/x.py:2)",
        f"    p.c -> p.a  ({PACKAGE}/x.py:3)"]
    assert _cycles(_graph(edges[:2] + edges[3:])) == []


def test_importing_a_submodule_runs_its_packages():
    """``from hyper_parallel.codegen.spec.project import x`` runs ``codegen/spec/__init__``."""
    modules = _modules()
    assert _packages_run_first("hyper_parallel.trainer.base", "hyper_parallel.codegen.spec.project",
                               modules) == {"hyper_parallel.codegen", "hyper_parallel.codegen.spec"}
    assert _packages_run_first("hyper_parallel.codegen.spec.types", "hyper_parallel.codegen.spec.project",
                               modules) == set()


def test_no_subpackage_cycle():
    """Between subpackages the door's calls up into codegen are left out: codegen reads the
    runtime (meta, loader, apply), so runtime -> codegen through the door would always close
    a circle at this granularity. Between modules it may not (``test_no_module_cycle``)."""
    cycles = _cycles(_graph(layered_edges(), key=subpackage))
    if cycles:
        pytest.fail("import cycles between subpackages:\n" + _describe(cycles, key=subpackage), pytrace=False)


def test_no_module_cycle():
    """No module reaches itself through any chain of imports: every edge counts, the door's
    function-level imports into codegen included (a circle hidden inside a function still
    runs, at the first call)."""
    cycles = _cycles(_graph(module_edges()))
    if cycles:
        pytest.fail("import cycles between modules:\n" + _describe(cycles), pytrace=False)


def _top(module: str) -> str:
    """The subpackage's own name (``codegen``), or the module's for a top-level module."""
    return _relative(subpackage(module))


def test_lower_layers_import_no_higher_one():
    bad = [edge for edge in layered_edges() if _top(edge.source) in LOWER and _top(edge.target) in HIGHER]
    if bad:
        pytest.fail(f"imports from {'/'.join(LOWER)} up into {'/'.join(HIGHER)}:\n"
                    + "\n".join(f"  {edge}" for edge in bad), pytrace=False)


def test_every_import_respects_the_layer_order():
    bad = [edge for edge in layered_edges() if _layer(edge.target) > _layer(edge.source)]
    if bad:
        order = "\n".join(f"  {i}: {', '.join(p or '<package root>' for p in prefixes)}"
                          for i, prefixes in enumerate(LAYERS))
        pytest.fail(f"imports that reach up a layer (layers, lowest first:\n{order}\n):\n"
                    + "\n".join(f"  {e}  [layer {_layer(e.source)} -> {_layer(e.target)}]" for e in bad),
                    pytrace=False)


def test_no_forbidden_import():
    bad = [edge for edge in layered_edges() if (_top(edge.source), _top(edge.target)) in FORBIDDEN]
    if bad:
        pytest.fail("imports the design rules out (the trainer reaches codegen through HyperAutoModel):\n"
                    + "\n".join(f"  {edge}" for edge in bad), pytrace=False)


def _module_level_imports(path: Path) -> list[tuple[str, int]]:
    """The imports a module runs when it is imported: those in its top-level statements
    (an ``if``/``try`` at the top counts; a function or class body does not)."""
    found, todo = [], list(ast.parse(path.read_text(encoding="utf-8")).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.module, node.lineno)] + [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, (ast.If, ast.Try)):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
    return found


# What training imports (below the build tool, or beside it as the model builders and the
# trainer are), and the build-time code it must never import: the build tool, and the
# planning it runs. Training applies a frozen plan; it never plans.
TRAINING_SIDE = ("runtime", "trainer", "distributed", "models", "components")
BUILD_TIME = ("planning", "codegen")


def test_the_training_side_imports_no_build_time_code():
    """runtime/, trainer/, distributed/, models/ and components/ import neither planning/
    nor codegen/, at any level, but for the door's late calls into codegen."""
    bad = [edge for edge in module_edges() if _top(edge.source) in TRAINING_SIDE
           and _top(edge.target) in BUILD_TIME and not _through_the_door(edge)]
    if bad:
        pytest.fail(f"imports from the training side ({'/'.join(TRAINING_SIDE)}) of build-time code "
                    f"({'/'.join(BUILD_TIME)}):\n" + "\n".join(f"  {edge}" for edge in bad), pytrace=False)


def test_the_training_side_reaches_the_build_tool_only_through_the_door():
    """Nothing under runtime/, models/ or trainer/ imports codegen, at any level, but the
    door (runtime/build.py); the door imports it only inside its functions; and the door
    does reach codegen (the reader sees its calls)."""
    outside = [str(edge) for edge in module_edges() if _top(edge.source) in ("runtime", "models", "trainer")
               and _top(edge.target) == "codegen" and edge.source != DOOR]
    assert not outside, "imports of the build tool that bypass runtime/build.py:\n" + "\n".join(outside)
    door = ROOT / "runtime" / "build.py"
    at_import = [f"{name} (line {line})" for name, line in _module_level_imports(door)
                 if name.startswith(f"{PACKAGE}.codegen")]
    assert not at_import, at_import
    assert any(_through_the_door(edge) for edge in module_edges())


def test_the_training_side_does_not_import_the_build_tool_at_module_level():
    """runtime/, models/ and trainer/ reach codegen only by a call that builds a bundle
    (imported inside that function), never on import: training imports no build tool."""
    found = []
    for part in ("runtime", "models", "trainer"):
        for path in sorted((ROOT / part).rglob("*.py")):
            found += [f"{path.relative_to(ROOT.parent)}:{line}: {name}" for name, line in _module_level_imports(path)
                      if name == f"{PACKAGE}.codegen" or name.startswith(f"{PACKAGE}.codegen.")]
    assert not found, "\n".join(found)


def test_generated_files_import_only_the_runtime():
    """A committed bundle's modeling file imports, of this package, only hyper_parallel.runtime."""
    bundles = sorted((ROOT.parent / "recipes").rglob("generated/modeling_*.py"))
    assert bundles  # the walk reached the committed bundles
    for path in bundles:
        ours = {name.split(".")[1] for name, _ in _module_level_imports(path) if name.startswith(PACKAGE + ".")}
        assert ours == {"runtime"}, (path, ours)


def test_no_test_imports_the_bench_folder():
    """bench/ is a folder of scripts, not a package: what the tests share with the benches
    lives in ``hyper_parallel/testing/``, which both import."""
    found = []
    for path in sorted((ROOT.parent / "tests").rglob("*.py")):
        for name, line, _ in _imported_names(ast.parse(path.read_text(encoding="utf-8")), "tests.x", False):
            if name == "bench" or name.startswith("bench."):
                found.append(f"{path.relative_to(ROOT.parent)}:{line}: {name}")
    assert not found, "\n".join(found)
