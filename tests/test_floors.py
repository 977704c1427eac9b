"""The floors of the house plan (who may import whom), checked on the source.

Every module of ``torchtitan/`` is parsed with ``ast`` (nothing is imported or run), and each
``import torchtitan...`` / ``from torchtitan... import ...`` / relative ``from . import ...``
statement is resolved to the modules of ours it names, wherever it stands (inside a function
or an ``if TYPE_CHECKING`` block too: a lazy import is still an import). Then:

* the core imports no product (``PRODUCTS``: predict.py's pipeline, export, demo data,
  pictures, what the helper scripts share);
* ``errors`` (the ground floor: ``UserError`` and how entry points show it) imports nothing
  of ours;
* the CellMap domain (``torchtitan/cellmap/``, floor 2) imports nothing of ours but
  ``errors`` (not the config schema);
* the config (the ``config`` package: the schema, its parsing and checks, floor 1)
  imports nothing of ours but itself and ``errors``;
* more generally, no module imports a module on a floor above its own (``FLOORS``), and on
  floor 3 models and data know nothing of each other.

The walker itself is tested on a small synthetic package, so that a rule cannot pass
because the walker missed an import.
"""

from __future__ import annotations

import ast
import fnmatch
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "torchtitan"


# ---------------------------------------------------------------------------------------------
# The walker
# ---------------------------------------------------------------------------------------------


def module_name(path: Path, root: Path) -> str:
    """``root/torchtitan/tasks/mae.py`` -> ``torchtitan.tasks.mae`` (a package's
    ``__init__.py`` is the package itself)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    base = module.split(".")
    if not is_package:
        base = base[:-1]  # a module's dots count from its package
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(path: Path, root: Path, package: str = PACKAGE) -> set[str]:
    """The modules of ``package`` that the source of ``path`` imports.

    ``from X import a, b`` counts as importing ``X`` and, where ``X.a`` is a module or
    package of ours, ``X.a`` too (``from torchtitan import evaluation``).
    """
    module = module_name(path, root)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(module, is_package, node.level, node.module)
            else:
                base = node.module or ""
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names
                      if _exists(root, f"{base}.{alias.name}")}
    return {name for name in found if name == package or name.startswith(package + ".")}


def _exists(root: Path, name: str) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_graph(root: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module name -> the modules of ours it imports, for every ``.py`` under ``root/package``."""
    return {module_name(p, root): imports_of(p, root, package)
            for p in sorted((root / package).rglob("*.py"))}


def within(name: str, prefix: str) -> bool:
    """Whether module ``name`` is ``prefix`` or inside it; ``prefix`` may end in a shell
    pattern (``torchtitan.demo*``: every module or package whose name starts so)."""
    parts = prefix.split(".")
    return fnmatch.fnmatchcase(".".join(name.split(".")[: len(parts)]), prefix) and \
        len(name.split(".")) >= len(parts)


def violations(graph: dict[str, set[str]], modules: str, allowed: tuple[str, ...],
               package: str = PACKAGE) -> dict[str, set[str]]:
    """For every module within ``modules``: the modules of ours it imports that are neither
    within ``modules`` itself nor within one of ``allowed``. The bare root package (its
    ``__init__.py`` only checks the Python version) counts as below every floor."""
    out = {}
    for name, imported in graph.items():
        if within(name, modules):
            bad = {m for m in imported if m != package and not within(m, modules)
                   and not any(within(m, a) for a in allowed)}
            if bad:
                out[name] = bad
    return out


def _is_product(name: str, products: tuple[str, ...]) -> bool:
    return any(within(name, p) for p in products)


def core_importing_products(graph: dict[str, set[str]],
                            products: tuple[str, ...]) -> dict[str, set[str]]:
    """Modules outside ``products`` that import something of ``products``."""
    out = {}
    for name, imported in graph.items():
        if not _is_product(name, products):
            bad = {m for m in imported if _is_product(m, products)}
            if bad:
                out[name] = bad
    return out


# ---------------------------------------------------------------------------------------------
# The rules, on the real package
# ---------------------------------------------------------------------------------------------

CONFIG = f"{PACKAGE}.config"  # the schema, its parsing and its checks
ERRORS = f"{PACKAGE}.errors"  # the ground floor
CHOICES = f"{PACKAGE}.choices"  # the ground floor: names and facts several floors share
# Floor 6, above the core: what serves people rather than the training loop.
PRODUCTS = tuple(f"{PACKAGE}.{p}" for p in ("prediction", "export", "demo", "pictures",
                                              "scripts"))


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(REPO)


def test_the_walker_sees_the_package(graph):
    """A sanity check: the graph holds the modules and edges we know to be there."""
    assert {"torchtitan.trainer", "torchtitan.cellmap.labels", "torchtitan.evaluation"} <= set(graph)
    assert "torchtitan.scoring.stores" in graph["torchtitan.evaluation"]
    assert f"{PACKAGE}.inference.sliding_window" in graph["torchtitan.tasks.segmentation"]
    assert "torchtitan.scoring.metrics" in graph["torchtitan.scoring.stores"]
    assert "torchtitan.models.vit" in graph["torchtitan.models.mae"]  # a relative import


def test_the_core_imports_no_product(graph):
    """Floor 6 (predict.py's pipeline, export, demo data, pictures, the helpers' shared parts)
    sits above the core; where the core needs a product's work, the entry script hands it
    in."""
    assert core_importing_products(graph, PRODUCTS) == {}


def test_errors_import_nothing_of_ours(graph):
    """The ground floor: every floor may raise a ``UserError``, so ``errors`` asks no one."""
    assert ERRORS in graph
    assert violations(graph, ERRORS, ()) == {}


def test_choices_import_nothing_of_ours(graph):
    """The ground floor: the config offers names that models and data implement, so
    ``choices`` asks no one."""
    assert CHOICES in graph
    assert violations(graph, CHOICES, ()) == {}


def test_the_domain_imports_nothing_above_it(graph):
    """Floor 2: every other floor may ask the domain (``torchtitan.cellmap``); it asks none
    of them, only the errors (not the config schema)."""
    assert violations(graph, f"{PACKAGE}.cellmap", (ERRORS, CHOICES)) == {}


def test_config_imports_nothing_of_ours(graph):
    """Floor 1: the config (the ``config`` package: the schema, its parsing and checks)
    imports nothing of ours but itself, the errors and the shared names."""
    assert f"{PACKAGE}.config.manager" in graph
    assert violations(graph, CONFIG, (ERRORS, CHOICES)) == {}


# Every module of ours on its floor (DESIGN.md, "Floors"), by the first prefix here that holds
# it. A new top-level module or package gets a line here.
FLOORS = {
    CONFIG: 1,
    ERRORS: 0,
    CHOICES: 0,
    f"{PACKAGE}.cellmap": 2,
    f"{PACKAGE}.models": 3,
    f"{PACKAGE}.data": 3,
    f"{PACKAGE}.evaluation": 3,  # python -m torchtitan.evaluation: the scoring command's old name
    f"{PACKAGE}.postprocess": 3,  # masks -> cleaned masks and instances, in memory or blockwise
    f"{PACKAGE}.scoring": 3,  # the CellMap metrics; scoring prediction stores
    f"{PACKAGE}.parallelisms": 4,
    f"{PACKAGE}.checkpoint": 4,  # saving, resuming, reading step folders, .pth <-> DCP
    f"{PACKAGE}.run": 4,  # the run's life: its lock, launch history, preemption
    f"{PACKAGE}.optimizer": 4,
    f"{PACKAGE}.logging_metrics": 4,
    f"{PACKAGE}.inference": 4,  # the sliding window; predict.py's pipeline is a product
    f"{PACKAGE}.trainer": 5,
    f"{PACKAGE}.tasks": 5,
    **{product: 6 for product in PRODUCTS},
}


def floor_of(name: str, floors: dict[str, int] = FLOORS) -> int | None:
    owners = [prefix for prefix in floors if within(name, prefix)]
    return floors[owners[0]] if owners else None


def upward_imports(graph: dict[str, set[str]], floors: dict[str, int] = FLOORS) -> list[str]:
    """``"a (floor i) imports b (floor j)"`` for every import of a higher floor."""
    out = []
    for name, imported in graph.items():
        here = floor_of(name, floors)
        for other in sorted(imported):
            there = floor_of(other, floors)
            if here is not None and there is not None and there > here:
                out.append(f"{name} (floor {here}) imports {other} (floor {there})")
    return out


def test_every_module_has_a_floor(graph):
    unplaced = [name for name in graph if name != PACKAGE and floor_of(name) is None]
    assert unplaced == [], f"place {unplaced} on a floor in FLOORS (tests/test_floors.py)"


def test_no_module_imports_a_floor_above_its_own(graph):
    assert upward_imports(graph) == []


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or around a loop (every import
    counts: at the top, inside a function, or for type checking only), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle(graph):
    """No two modules import each other, not even for a type annotation: a module that needs
    a type of the one importing it names it in its docstring instead."""
    assert import_cycles(graph) == []


def package_graph(graph: dict[str, set[str]], root: Path = REPO) -> dict[str, set[str]]:
    """Package -> the packages its modules import (a module counts for the package that holds
    it; a package's ``__init__`` for the package itself; imports within one package, or between
    a package and one inside it, are left out)."""
    def package(name: str) -> str:
        is_package = (root.joinpath(*name.split(".")) / "__init__.py").is_file()
        return name if is_package else name.rsplit(".", 1)[0]

    out: dict[str, set[str]] = {}
    for name, imported in graph.items():
        a = package(name)
        out.setdefault(a, set())
        for other in imported:
            b = package(other)
            if not (within(a, b) or within(b, a)):
                out[a].add(b)
    return out


# Package loops that remain, each with what removes it. A new loop fails the test below; so
# does a listed one that is gone (take it off the list).
KNOWN_PACKAGE_LOOPS: dict[tuple[str, ...], str] = {}


def test_no_package_loop_but_the_known_ones(graph):
    loops = {tuple(c) for c in import_cycles(package_graph(graph))}
    assert loops == set(KNOWN_PACKAGE_LOOPS), sorted(loops ^ set(KNOWN_PACKAGE_LOOPS))


def test_the_data_seam_sits_on_top_of_the_data(graph):
    """``data/volume_source.py`` (the one face the tasks see) may use every data package; none of
    them uses it back (the package graph leaves out imports between a package and one inside
    it, so this one is checked by name)."""
    seam = {f"{PACKAGE}.data.{p.stem}" for p in (REPO / PACKAGE / "data").glob("*.py")
            if p.stem != "__init__"}
    assert seam, "no module directly in torchtitan/data"
    upward = sorted((name, m) for name, imported in graph.items()
                    if within(name, f"{PACKAGE}.data") and name not in seam
                    and name != f"{PACKAGE}.data" for m in imported if m in seam)
    assert not upward, upward


def test_a_package_loop_is_found(tmp_path):
    _write(tmp_path, {**CLEAN, "torchtitan/pictures/drawing.py": "import numpy\n",
                      "torchtitan/tasks/seg.py": "from torchtitan.pictures import drawing\n",
                      "torchtitan/pictures/__init__.py": "from torchtitan.tasks import base\n"})
    g = package_graph(import_graph(tmp_path), tmp_path)
    assert import_cycles(g) == [["torchtitan.pictures", "torchtitan.tasks"]]


def test_an_import_cycle_is_found(tmp_path):
    _write(tmp_path, {**CLEAN, "torchtitan/cellmap/__init__.py": "",
                      "torchtitan/cellmap/labels.py": "from torchtitan.cellmap import grids\n",
                      "torchtitan/cellmap/grids.py": "def f():\n    from .labels import rule\n"})
    assert import_cycles(import_graph(tmp_path)) == [["torchtitan.cellmap.grids",
                                                       "torchtitan.cellmap.labels"]]


def test_models_and_data_know_nothing_of_each_other(graph):
    """Floor 3: models know nothing of data; the data knows nothing of models."""
    assert all(not within(m, f"{PACKAGE}.data") for name, imported in graph.items()
               if within(name, f"{PACKAGE}.models") for m in imported)
    assert all(not within(m, f"{PACKAGE}.models") for name, imported in graph.items()
               if within(name, f"{PACKAGE}.data") for m in imported)


# ---------------------------------------------------------------------------------------------
# The walker, on a synthetic package
# ---------------------------------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


CLEAN = {
    "torchtitan/__init__.py": "",
    "torchtitan/config/__init__.py": "",
    "torchtitan/config/manager.py": "import os\nfrom .parsing import parse\n",
    "torchtitan/config/parsing.py": "import tomllib\nfrom torchtitan.errors import E\n",
    "torchtitan/errors.py": "import sys\n",
    "torchtitan/cellmap/__init__.py": "from .labels import rule\n",
    "torchtitan/cellmap/labels.py": "from torchtitan.errors import os\nrule = 1\n",
    "torchtitan/evaluation.py": "from torchtitan.cellmap.labels import rule\n",
    "torchtitan/tasks/__init__.py": "",
    "torchtitan/tasks/seg.py": "from .. import evaluation\nfrom . import base\n",
    "torchtitan/tasks/base.py": "",
    "torchtitan/pictures/__init__.py": "",
    "torchtitan/pictures/drawing.py": "from torchtitan.tasks import seg\nimport numpy\n",
}


def test_walker_resolves_absolute_relative_and_from_package_imports(tmp_path):
    _write(tmp_path, CLEAN)
    g = import_graph(tmp_path)
    assert g["torchtitan.cellmap"] == {"torchtitan.cellmap.labels"}
    assert g["torchtitan.tasks.seg"] == {"torchtitan", "torchtitan.evaluation", "torchtitan.tasks",
                                         "torchtitan.tasks.base"}
    assert g["torchtitan.pictures.drawing"] == {"torchtitan.tasks", "torchtitan.tasks.seg"}
    assert g["torchtitan.config.manager"] == {"torchtitan.config.parsing"}
    assert core_importing_products(g, PRODUCTS) == {}
    assert violations(g, ERRORS, ()) == {}
    assert violations(g, "torchtitan.cellmap", (ERRORS,)) == {}
    assert violations(g, CONFIG, (ERRORS,)) == {}
    assert upward_imports(g) == []


def test_upward_imports_are_found(tmp_path):
    _write(tmp_path, {**CLEAN, "torchtitan/evaluation.py": "from .tasks import seg\n"})
    assert upward_imports(import_graph(tmp_path)) == [
        "torchtitan.evaluation (floor 3) imports torchtitan.tasks (floor 5)",
        "torchtitan.evaluation (floor 3) imports torchtitan.tasks.seg (floor 5)",
    ]


@pytest.mark.parametrize("path, source, rule", [
    # The core importing a product, in every spelling: absolute, from the package, relative,
    # lazily inside a function.
    ("torchtitan/tasks/seg.py", "from torchtitan.pictures.drawing import draw\n", "products"),
    ("torchtitan/tasks/seg.py", "import torchtitan.pictures.drawing\n", "products"),
    ("torchtitan/tasks/seg.py", "from torchtitan.pictures import drawing\n", "products"),
    ("torchtitan/tasks/seg.py", "from ..pictures import drawing\n", "products"),
    ("torchtitan/evaluation.py", "from .pictures.drawing import draw\n", "products"),
    ("torchtitan/evaluation.py", "def f():\n    from torchtitan import pictures\n", "products"),
    # The domain asking a floor above it.
    ("torchtitan/cellmap/labels.py", "from torchtitan.evaluation import x\n", "cellmap"),
    ("torchtitan/cellmap/labels.py", "from .. import evaluation\n", "cellmap"),
    ("torchtitan/cellmap/__init__.py", "from ..tasks.seg import x\n", "cellmap"),
    ("torchtitan/cellmap/labels.py", "from torchtitan.config.manager import x\n", "cellmap"),
    # The config importing anything of ours but the errors.
    ("torchtitan/config/manager.py", "from torchtitan.cellmap import x\n", "config"),
    ("torchtitan/config/manager.py", "from .. import cellmap\n", "config"),
    ("torchtitan/config/parsing.py", "import torchtitan.evaluation\n", "config"),
    # The errors importing anything of ours.
    ("torchtitan/errors.py", "from torchtitan.config.manager import x\n", "errors"),
    ("torchtitan/errors.py", "from . import cellmap\n", "errors"),
])
def test_each_rule_fails_on_a_forbidden_import(tmp_path, path, source, rule):
    _write(tmp_path, {**CLEAN, path: source})
    g = import_graph(tmp_path)
    found = {
        "products": core_importing_products(g, PRODUCTS),
        "errors": violations(g, ERRORS, ()),
        "cellmap": violations(g, "torchtitan.cellmap", (ERRORS,)),
        "config": violations(g, CONFIG, (ERRORS,)),
    }
    assert found[rule], f"{rule} rule missed {source!r} in {path}"
    assert module_name(tmp_path / path, tmp_path) in found[rule]
