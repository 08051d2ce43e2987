"""No import cycle in the torchtitan package, counting imports inside functions, and no
import of the test support (harness/) from it.

The graph is read from the source with ``ast`` (nothing is imported): every ``import``
and ``from ... import``, at module level or in a function, relative ones resolved, and
``from pkg import name`` pointing at the submodule ``pkg.name`` when there is one.

Package ``__init__`` files, counted as Python runs them:
- An import names its deepest module: ``from torchtitan.data.loader import X`` is an
  edge to ``torchtitan.data.loader``; ``from torchtitan.data import X`` (X not a
  submodule) is an edge to ``torchtitan/data/__init__.py``, also from inside the data
  package, where it closes a cycle if that ``__init__`` imports the importer.
- Importing a submodule first runs each package above it, so it is also an edge to
  those packages' ``__init__`` files, except to the importer's own packages: those have
  started before the importer runs, so they add no dependency. This is why a package's
  ``__init__`` may re-export its own submodules, while ``torchtitan.models.attention``
  importing ``torchtitan.config.schema`` depends on ``torchtitan/config/__init__.py``.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

from torchtitan import REPO_ROOT
from torchtitan.config.validate import COMPONENTS


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the package at ``root`` (a folder with __init__.py)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported_names(tree: ast.AST, module: str, is_package: bool):
    """(dotted names, line) for each name an import statement in ``tree`` brings in:
    the names it could be, the first one that is a module being the one imported."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield [alias.name], node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = ".".join(package[: len(package) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:  # a submodule if there is one, else a name in base
                yield [f"{base}.{alias.name}", base], node.lineno


def import_graph(root: Path) -> dict[str, dict[str, str]]:
    """module -> {imported module: "file:line" of the first import}, within the package."""
    modules = module_files(root)
    graph: dict[str, dict[str, str]] = {name: {} for name in modules}
    for name, path in modules.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        tree = ast.parse(path.read_text(), str(path))
        for candidates, line in _imported_names(tree, name, path.name == "__init__.py"):
            target = next((c for c in candidates if c in modules), None)
            if target is None:
                continue  # another package
            parents = {".".join(target.split(".")[:i]) for i in range(1, target.count(".") + 1)}
            for dep in {target} | (parents - own):
                if dep != name and dep in modules:
                    graph[name].setdefault(dep, f"{path.relative_to(root.parent)}:{line}")
    return graph


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan), as a path
    that starts and ends at the same module."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(v):  # recursion depth is bounded by the package's module count
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph, group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths, seen = [[start]], set()
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]]):
            if w == start:
                return [*path, start]
            if w in group and w not in seen:
                seen.add(w)
                paths.append([*path, w])
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def describe(graph, cycle: list[str]) -> str:
    """The cycle with where each import is: 'a (a.py:3) -> b (b.py:2) -> a'."""
    steps = [f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join([*steps, cycle[-1]])


def test_torchtitan_has_no_import_cycle():
    graph = import_graph(REPO_ROOT / "torchtitan")
    assert len(graph) > 40 and graph["torchtitan.data.loader"], "the walk found the package"
    cycles = [describe(graph, c) for c in find_cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def reachable(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_config_names_the_components_it_validates_without_importing_them():
    """Validation runs each component's check_config, found by module name: the config
    package reaches none of them in the graph, and importing it loads none of them."""
    graph = import_graph(REPO_ROOT / "torchtitan")
    config_deps = set().union(
        *(reachable(graph, m) for m in graph if m.startswith("torchtitan.config"))
    )
    for name in COMPONENTS:
        assert callable(importlib.import_module(name).check_config), name
        assert name not in config_deps and "torchtitan.config" in reachable(graph, name)
    code = "import sys, torchtitan.config; print(sorted(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO_ROOT, check=True).stdout  # fmt: skip
    for package in ("torchtitan.data", "torchtitan.models", "torchtitan.parallel", "'torch'"):
        assert package not in loaded, f"import torchtitan.config loads {package}"


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    """Negative control: two modules importing each other, one of them inside a
    function; and a package __init__ importing its own submodule is no cycle."""
    pkg = tmp_path / "planted"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from planted import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n    return g\n")
    (pkg / "sub" / "__init__.py").write_text("from planted.sub.c import C\n")
    (pkg / "sub" / "c.py").write_text("from . import d\nC = 1\n")
    (pkg / "sub" / "d.py").write_text("")
    graph = import_graph(pkg)
    assert find_cycles(graph) == [["planted.a", "planted.b", "planted.a"]]
    assert "planted.a" in describe(graph, find_cycles(graph)[0])
    # Importing sub.c from outside sub runs sub/__init__.py first: a dependency on it.
    (pkg / "sub" / "__init__.py").write_text("from . import d\n")
    (pkg / "sub" / "c.py").write_text("")
    (pkg / "sub" / "d.py").write_text("def f():\n    from planted import e\n")
    (pkg / "e.py").write_text("import planted.sub.c\n")
    cycles = find_cycles(import_graph(pkg))
    assert ["planted.e", "planted.sub", "planted.sub.d", "planted.e"] in cycles


TEST_SUPPORT = ("harness", "helpers", "test", "scripts")


def imports_of_test_support(root: Path) -> list[str]:
    """'file:line name' of each import in the package at ``root`` of a module that only
    the tests and benchmarks have (``harness``, ``test/helpers.py``, ``scripts``)."""
    found = []
    for name, path in module_files(root).items():
        tree = ast.parse(path.read_text(), str(path))
        for candidates, line in _imported_names(tree, name, path.name == "__init__.py"):
            top = candidates[-1].split(".")[0]
            if top in TEST_SUPPORT:
                found.append(f"{path.relative_to(root.parent)}:{line} {candidates[-1]}")
    return found


def test_the_product_imports_none_of_its_test_support(tmp_path):
    """torchtitan stands without harness/ (the tests' and benchmarks' support): no module
    imports it, at module level or in a function. Negative control: a planted one does."""
    assert not imports_of_test_support(REPO_ROOT / "torchtitan")
    pkg = tmp_path / "planted"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from harness.io_count import counting\n")
    assert imports_of_test_support(pkg) == ["planted/a.py:2 harness.io_count"]


# ---- who reads the streaming flag ------------------------------------------------------

# The source kinds answer for themselves (fingerprint fields, plan inspection, count
# keys): only they read ``training.streaming``; every other module asks the source.
STREAMING_READERS = ("torchtitan/data/sources", "torchtitan/data/streaming")


def streaming_reads(source: str, path: str) -> list[str]:
    """'path:line' of each read of a ``streaming`` attribute (``x.streaming``,
    ``getattr(x, "streaming")``) in ``source``, unless ``path`` is a source kind's module
    (``data/sources*``, ``data/streaming*``)."""
    if path.startswith(STREAMING_READERS):
        return []
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Attribute) and node.attr == "streaming":
            found.append(f"{path}:{node.lineno}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value == "streaming"):  # fmt: skip
            found.append(f"{path}:{node.lineno}")
    return found


def test_only_the_source_kinds_read_the_streaming_flag():
    files = [REPO_ROOT / "train.py", *sorted((REPO_ROOT / "torchtitan").rglob("*.py"))]
    reads = [hit for f in files
             for hit in streaming_reads(f.read_text(), f.relative_to(REPO_ROOT).as_posix())]  # fmt: skip
    assert not reads, f"training.streaming read outside the source kinds: {reads}"
    sources = (REPO_ROOT / "torchtitan/data/sources.py").read_text()
    assert streaming_reads(sources, "torchtitan/data/sources.py") == []
    assert "training.streaming" in sources, "the walk looks where the flag is read"


def test_a_planted_read_of_the_streaming_flag_is_found():
    """Negative control: a plan that branches on the flag, a getattr of it, and the same
    read inside a source kind's module (allowed)."""
    planted = "def inspect(training):\n    if training.streaming:\n        return 1\n"
    assert streaming_reads(planted, "torchtitan/data/plan.py") == ["torchtitan/data/plan.py:2"]
    assert streaming_reads("x = getattr(t, 'streaming')\n", "train.py") == ["train.py:1"]
    assert streaming_reads(planted, "torchtitan/data/streaming_x.py") == []
    assert streaming_reads(planted, "torchtitan/data/sources.py") == []


# ---- the data side imports no checkpoint code ------------------------------------------


def data_reaching_checkpoint(graph, package: str = "torchtitan") -> dict[str, list[str]]:
    """Each module of ``package.data`` that reaches ``package.checkpoint`` through the
    graph (imports inside functions count), with the checkpoint modules it reaches."""
    data, checkpoint = f"{package}.data", f"{package}.checkpoint"
    found = {}
    for module in sorted(graph):
        if module == data or module.startswith(data + "."):
            hits = sorted(m for m in reachable(graph, module)
                          if m == checkpoint or m.startswith(checkpoint + "."))  # fmt: skip
            if hits:
                found[module] = hits
    return found


def test_the_data_package_imports_no_checkpoint_code():
    """The loader's entry is the data side's (data/state.py); the checkpoint adapter wraps
    it. So torchtitan.data reaches no torchtitan.checkpoint module, and importing it loads
    neither the checkpoint package nor DCP."""
    graph = import_graph(REPO_ROOT / "torchtitan")
    assert "torchtitan.data.state" in reachable(graph, "torchtitan.data.loader")
    found = data_reaching_checkpoint(graph)
    assert not found, f"torchtitan.data imports checkpoint code: {found}"
    code = "import sys, torchtitan.data; print(sorted(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO_ROOT, check=True).stdout  # fmt: skip
    for package in ("'torchtitan.checkpoint", "'torch.distributed.checkpoint"):
        assert package not in loaded, f"import torchtitan.data loads {package[1:]}"


def test_a_planted_checkpoint_import_in_the_data_package_is_found(tmp_path):
    """Negative control: a data module importing the checkpoint package lazily (inside a
    function), and one reaching it through another package's module; a checkpoint module
    importing the data package is no finding."""
    pkg = tmp_path / "planted"
    for folder in (pkg / "data", pkg / "checkpoint"):
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "loader.py").write_text("def f():\n    from planted.checkpoint import x\n")
    (pkg / "checkpoint" / "x.py").write_text("from planted.data import loader\n")
    (pkg / "data" / "plan.py").write_text("import planted.tools\n")
    (pkg / "tools.py").write_text("from planted.checkpoint.x import y\n")
    found = data_reaching_checkpoint(import_graph(pkg), "planted")
    assert sorted(found) == ["planted.data.loader", "planted.data.plan"]
    assert "planted.checkpoint.x" in found["planted.data.plan"]
    (pkg / "data" / "loader.py").write_text("")
    (pkg / "data" / "plan.py").write_text("")
    assert data_reaching_checkpoint(import_graph(pkg), "planted") == {}


def defined_names(tree: ast.Module) -> set[str] | None:
    """Names a module defines at its top level (in ``if``/``try`` blocks too), or None
    when it cannot be known statically (``import *``, a module ``__getattr__``)."""
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
            targets = node.targets if isinstance(node, ast.Assign) else [
                getattr(node, "target", None), *[i.optional_vars for i in getattr(node, "items", [])]]  # fmt: skip
            for target in filter(None, targets):
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.While)):
            for block in ("body", "orelse", "finalbody"):
                todo.extend(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                todo.extend(handler.body)
    return names


def _local_module(dotted: str, roots: list[Path]) -> Path | None:
    """The file a dotted name imports from the first root holding it, or None (a module
    from outside the repository)."""
    for root in roots:
        base = root.joinpath(*dotted.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
    return None


def missing_imported_names(files: list[Path], repo: Path) -> list[str]:
    """'file:line module.name' for each ``from module import name`` where ``module`` is the
    repository's (resolved as Python would for that file: its own folder first for a
    script, then the repository's root and test/) and defines no ``name`` and has no
    submodule ``name``: an ImportError waiting for the first run. Ruff checks one file at
    a time and cannot see it; a script the slow tier alone runs would show it only in CI."""
    found, parsed = [], {}
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        roots = [path.parent, repo, repo / "test"]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            source = _local_module(node.module, roots)
            if source is None:
                continue
            if source not in parsed:
                parsed[source] = defined_names(ast.parse(source.read_text(), str(source)))
            names = parsed[source]
            for alias in node.names:
                if names is None or alias.name in names or alias.name == "*":
                    continue
                if _local_module(f"{node.module}.{alias.name}", roots) is None:
                    found.append(
                        f"{path.relative_to(repo)}:{node.lineno} {node.module}.{alias.name}"
                    )
    return found


def repository_python(repo: Path) -> list[Path]:
    """Every Python file of the product, its scripts, tests and test support."""
    folders = ("torchtitan", "scripts", "test", "harness")
    return [repo / "train.py", *(p for f in folders for p in sorted((repo / f).rglob("*.py")))]


def test_every_name_imported_from_the_repository_exists():
    """A campaign script imported a helper renamed elsewhere; only the slow tier ran it,
    so CI found it after 17 minutes. Every ``from <repository module> import name`` in
    the product, the scripts and the tests names something that module defines."""
    files = repository_python(REPO_ROOT)
    assert len(files) > 150
    assert missing_imported_names(files, REPO_ROOT) == []


def test_a_name_imported_from_a_sibling_script_that_it_lacks_is_found(tmp_path):
    """Negative control: a script importing a name its sibling does not define (the CI
    failure's shape), beside imports that do resolve: a function, a name bound in a
    ``try``, a submodule, and a module from outside the repository."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub.py").write_text("")
    (tmp_path / "tools.py").write_text(
        "def command(): pass\ntry:\n    import json as codec\nexcept ImportError:\n    codec = None\n"
    )
    (tmp_path / "run.py").write_text(
        "from tools import command, codec, workers_of\nfrom pkg import sub\nfrom os import path\n"
    )
    assert missing_imported_names([tmp_path / "run.py"], tmp_path) == ["run.py:1 tools.workers_of"]
