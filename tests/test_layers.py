"""The package's layering (docs/architecture.md), checked by reading the imports with `ast`.

Lower layers never import higher ones, and no module imports itself back through others.
No algorithm imports another (what two share lives in algorithms/common.py or runtime/)
unless it is built on the other's public machinery (BUILDS_ON, one way), and no module imports another's _private name (PRIVATE_IMPORTS_ALLOWED says which still do).
Imports inside functions count as much as those at the top: a lazy import is still a
dependency, and hiding a climb inside a function is how cycles creep back in.

Serial and fast (parses the sources; imports nothing of distbelief).
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first. A module belongs to the entry with the longest prefix of its dotted name.
# "distbelief" (the package's __init__) re-exports the public API (distbelief.api:
# load_model), which stands on model, data and records, so it sits in the "api" layer,
# above everything the trainers use and below the command line. The launch sets a run up
# for any trainer (imported by name, through the registry), above them all. The
# algorithms' registry (names and "module:function" strings, importing nothing) sits low
# so config can read it, and so do the options: how a key is declared
# (distbelief.options) and each algorithm's options module (a pattern: "*" stands for its
# package under algorithms/), which config reads.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("distbelief.errors",)),
    ("options", ("distbelief.options", "distbelief.algorithms.*.options")),
    ("registry", ("distbelief.algorithms.registry",)),
    # runtime is one layer; its subpackages (by role) sit in it, with its top-level modules.
    ("runtime", ("distbelief.runtime", "distbelief.runtime.communicators",
                 "distbelief.runtime.health", "distbelief.runtime.launching")),
    ("model", ("distbelief.model",)),
    ("data", ("distbelief.data",)),
    ("ps", ("distbelief.ps",)),
    ("config", ("distbelief.config",)),
    ("records", ("distbelief.records",)),
    ("skeleton", ("distbelief.algorithms.common", "distbelief.algorithms.session",
                  "distbelief.algorithms.checkpointer")),
    ("algorithms", ("distbelief.algorithms",)),
    ("launch", ("distbelief.algorithms.launch",)),
    ("compare", ("distbelief.compare",)),
    ("api", ("distbelief", "distbelief.api", "distbelief.training", "distbelief.torch")),
    ("cli", ("distbelief.cli", "distbelief.cli_help", "distbelief.cli_prepare",
             "distbelief.cli_types", "distbelief.__main__")),
]


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(src: Path) -> dict[str, Path]:
    """Every module under src/distbelief, by dotted name (packages by their __init__)."""
    return {module_name(p, src): p for p in sorted((src / "distbelief").rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The distbelief modules `name` imports anywhere in its source (functions included).
    `from a.b import c` is module a.b.c when that is a module, else a.b; a compiled
    extension (model._kernels) has no source and counts as its package."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name.split(".")
                package = package if is_package else package[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a.b.c (not a file) -> a.b
                target = target.rpartition(".")[0]
            if target.startswith("distbelief") and target != name:
                found.add(target)
    return found


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer index)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = fnmatch.fnmatchcase(module, prefix) or module.startswith(prefix + ".")
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def import_graph(src: Path) -> dict[str, set[str]]:
    modules = find_modules(src)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def climbs(graph: dict[str, set[str]]) -> list[str]:
    """'a imports b' for each import from a higher layer."""
    out = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            low, high = layer_of(module), layer_of(target)
            if low is not None and high is not None and high > low:
                out.append(f"{module} ({LAYERS[low][0]}) imports {target} "
                           f"({LAYERS[high][0]}, a higher layer)")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


SHARED_BY_ALGORITHMS = ("distbelief.algorithms.common", "distbelief.algorithms.session",
                        "distbelief.algorithms.checkpointer", "distbelief.algorithms.registry",
                        "distbelief.algorithms.launch")
"""The modules of the algorithms layer that every algorithm may import, and the launch
(a layer above them), which sets a run up for whichever trainer the registry names."""

PRIVATE_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {}
"""(importer, source) pairs that may still import a _private name, each with why."""

BUILDS_ON = {
    ("distbelief.algorithms.averaging", "distbelief.algorithms.downpour"):
        "EASGD: a replica role and a shard rule on Downpour's machinery",
    ("distbelief.algorithms.diloco", "distbelief.algorithms.downpour"):
        "asynchronous DiLoCo: a replica role and the outer optimizer on Downpour's shards",
    ("distbelief.algorithms.diloco", "distbelief.algorithms.averaging"):
        "synchronous DiLoCo: the averaging collective with an outer step",
}
"""(algorithm, base) pairs where one algorithm is built on another's public machinery and
so imports it, each with why. One way only: a base never imports what is built on it."""


def algorithm_of(module: str) -> str | None:
    """The algorithm a module of the algorithms layer belongs to (its package or module
    right under distbelief.algorithms); None for the shared ones and other layers."""
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["distbelief", "algorithms"]:
        return None
    top = ".".join(parts[:3])
    return None if top in SHARED_BY_ALGORITHMS else top


def sideways(graph: dict[str, set[str]]) -> list[str]:
    """'a imports b' for each import between two different algorithms."""
    found = []
    for module, targets in sorted(graph.items()):
        mine = algorithm_of(module)
        for target in sorted(targets):
            theirs = algorithm_of(target)
            if mine and theirs and mine != theirs and (mine, theirs) not in BUILDS_ON:
                found.append(f"{module} imports {target}, another algorithm's")
    return found


def private_imports(src: Path) -> list[tuple[str, str, str]]:
    """(a, b, _name) for each `from b import _name` in module a, b a distbelief module."""
    found = []
    for name, path in find_modules(src).items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found += [(name, base, alias.name) for alias in node.names
                      if base.startswith("distbelief") and alias.name.startswith("_")
                      and not alias.name.startswith("__")]
    return found


def allowed(importer: str, source: str, private: str) -> bool:
    # A module may use its own package's private parts (model.kernels and
    # model.subnormals the compiled model._kernels): only another package's are off limits.
    return (importer.rsplit(".", 1)[0] == source
            or (importer, source) in PRIVATE_IMPORTS_ALLOWED
            or (importer, f"{source}.{private}") in PRIVATE_IMPORTS_ALLOWED)


# -- the package itself ----------------------------------------------------------------------

def test_every_module_has_a_layer() -> None:
    missing = [m for m in find_modules(SRC) if layer_of(m) is None]
    assert not missing, f"add these to LAYERS (and docs/architecture.md): {missing}"


def test_no_layer_imports_a_higher_one() -> None:
    found = climbs(import_graph(SRC))
    assert not found, "lower layers import higher ones:\n" + "\n".join(found)


def test_no_import_cycles() -> None:
    found = cycles(import_graph(SRC))
    assert not found, f"import cycles: {found}"


def test_no_algorithm_imports_another() -> None:
    found = sideways(import_graph(SRC))
    assert not found, ("move what two algorithms share down (algorithms/common.py, "
                       "runtime/):\n" + "\n".join(found))


def test_what_an_algorithm_builds_on_is_one_way() -> None:
    # A base may build on a third (diloco -> averaging -> downpour); no loop.
    graph: dict[str, set[str]] = {}
    for algorithm, base in BUILDS_ON:
        graph.setdefault(algorithm, set()).add(base)
    assert not cycles(graph), f"BUILDS_ON goes both ways: {cycles(graph)}"


def test_every_builds_on_pair_is_still_made() -> None:
    made = {(algorithm_of(module), algorithm_of(target))
            for module, targets in import_graph(SRC).items() for target in targets}
    stale = [pair for pair in BUILDS_ON if pair not in made]
    assert not stale, f"remove these from BUILDS_ON: {stale}"


def test_no_private_name_is_imported_from_another_module() -> None:
    found = [f"{a} imports {b}.{name}" for a, b, name in private_imports(SRC)
             if not allowed(a, b, name)]
    assert not found, "make these public, or move them:\n" + "\n".join(found)


def test_every_private_import_still_allowed_is_still_made() -> None:
    made = private_imports(SRC)
    stale = [key for key in PRIVATE_IMPORTS_ALLOWED
             if not any(key in ((a, b), (a, f"{b}.{name}")) for a, b, name in made)]
    assert not stale, f"remove these from PRIVATE_IMPORTS_ALLOWED: {stale}"


def test_the_graph_sees_the_imports_we_know_of() -> None:
    """Guards the checker against passing because it parsed nothing."""
    graph = import_graph(SRC)
    assert "distbelief.runtime.communicators.topology" in graph["distbelief.ps.rma_shard"]
    assert "distbelief.model.layers" in graph["distbelief.model.network"]
    assert "distbelief.algorithms.common" in graph["distbelief.cli"]  # inside a function
    assert "distbelief.model" in graph["distbelief.model.kernels"]  # the compiled _kernels
    assert "distbelief.api" in graph["distbelief"]  # the package re-exports load_model


FAULT_SEAMS = {
    "Faults.for_rank(": {"distbelief/algorithms/session.py", "distbelief/cli.py"},
    "faults.push_slots(": {"distbelief/algorithms/downpour/run.py"},
}
"""Where the source may read the test-only faults (DISTBELIEF_FAULTS): a run reads them
once, in its RunSession (session.faults), and every role takes them from there; the
command line once more, before MPI_Init (no session yet); the RMA push-slot override is
handed to the parameter server in its ServerSpec by the run that opens it."""


def test_test_only_faults_enter_through_one_seam() -> None:
    for call, places in FAULT_SEAMS.items():
        found = {path.relative_to(SRC).as_posix()
                 for path in (SRC / "distbelief").rglob("*.py") if call in path.read_text()}
        assert found == places, (f"{call} in {sorted(found)}; take the faults from the "
                                 f"run's session (session.faults) instead")
    graph = import_graph(SRC)
    faults = "distbelief.runtime.launching.faults"
    into_ps = sorted(m for m, targets in graph.items()
                     if m.startswith("distbelief.ps") and faults in targets)
    assert not into_ps, f"{into_ps} import {faults}: pass what they need in (ServerSpec)"


# -- the checker, on a made-up tree ----------------------------------------------------------

@pytest.fixture
def bad_tree(tmp_path: Path) -> Path:
    files = {
        "distbelief/__init__.py": "",
        "distbelief/runtime/__init__.py": "",
        "distbelief/runtime/loop.py": "def f():\n    from distbelief.ps import shard\n",
        "distbelief/ps/__init__.py": "",
        "distbelief/ps/shard.py": "from . import other\n",
        "distbelief/ps/other.py": "import distbelief.ps.shard\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_checker_finds_a_climb_and_a_cycle(bad_tree: Path) -> None:
    graph = import_graph(bad_tree)
    climb = "distbelief.runtime.loop (runtime) imports distbelief.ps.shard (ps, a higher layer)"
    assert climbs(graph) == [climb]
    assert cycles(graph) == [["distbelief.ps.other", "distbelief.ps.shard"]]


def test_the_checker_finds_a_sideways_import_and_a_private_name(tmp_path: Path) -> None:
    files = {
        "distbelief/__init__.py": "",
        "distbelief/algorithms/__init__.py": "",
        "distbelief/algorithms/common.py": "_SECRET = 1\n",
        "distbelief/algorithms/one.py": "from distbelief.algorithms.common import _SECRET\n",
        "distbelief/algorithms/two/__init__.py": "from . import inner\n",
        "distbelief/algorithms/two/inner.py": "def f():\n    from distbelief.algorithms import one\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert sideways(import_graph(tmp_path)) == [
        "distbelief.algorithms.two.inner imports distbelief.algorithms.one, another algorithm's"]
    assert private_imports(tmp_path) == [
        ("distbelief.algorithms.one", "distbelief.algorithms.common", "_SECRET")]


def test_no_test_file_imports_another() -> None:
    """Shared test code lives in conftest.py (fixtures) and tests/helpers/ (functions). The
    lines are read as text, so the code a test runs with `python -c` counts too."""
    tests = Path(__file__).resolve().parent
    found = [f"{path.name} imports {module}"
             for path in sorted([*tests.glob("*.py"), *tests.glob("helpers/*.py")])
             for module in re.findall(r"^\s*(?:import|from) (test_\w+)", path.read_text(), re.MULTILINE)]
    assert not found, "\n".join(found)
