"""The layers of DESIGN §10 stay layers: the contracts of pyproject.toml hold (import-linter),
no module reads another module's private names, no import circle between files or folders.

Read statically with `ast` (nothing is imported), counting every `import`, function-level and
`TYPE_CHECKING` ones included: a circle hidden inside a function is still a circle for a
reader. `tandem.X.Y` belongs to the folder `tandem.X`; a top-level module is its own folder.
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

# Known circles that another branch of the restructuring (issue 12) removes; each entry is the
# exact set of modules (or folders) of one circle. Delete an entry when its branch lands, and
# the guard covers that part too.
KNOWN_FILE_CIRCLES: set[frozenset[str]] = set()
KNOWN_FOLDER_CIRCLES: set[frozenset[str]] = set()
# Modules that still read another module's private names (issue 39 removes them).
KNOWN_PRIVATE_READERS: set[str] = set()


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "tandem").rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


@functools.cache
def _trees() -> dict[str, ast.Module]:
    """Every module's syntax tree, parsed once for the file's tests (parsing the ~300 files took
    a few seconds per test)."""
    return {module: ast.parse(path.read_text(), str(path)) for module, path in modules().items()}


def _imported(module: str, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if known[module].name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    # `from tandem.comm.agreement import checks` imports the module tandem.comm.agreement.checks.
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
            for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the tandem modules it imports anywhere in its body (a fresh copy each call)."""
    return {module: set(deps) for module, deps in _import_graph().items()}


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    known = modules()
    trees = _trees()
    graph: dict[str, set[str]] = {}
    for module in known:
        deps = set()
        for node in ast.walk(trees[module]):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(module, node, known):
                while name not in known and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in known and name != module and name.split(".")[0] == "tandem":
                    deps.add(name)
        graph[module] = deps
    return graph


def folder(module: str, known: dict[str, Path]) -> str:
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and known[module].name == "__init__.py"):
        return ".".join(parts[:2])
    return module


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    known = modules()
    folders: dict[str, set[str]] = {folder(m, known): set() for m in graph}
    for module, deps in graph.items():
        for dep in deps:
            a, b = folder(module, known), folder(dep, known)
            if a != b:
                folders[a].add(b)
    return folders


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def cycle_path(component: list[str], graph: dict[str, set[str]]) -> str:
    """One circle through the component, as `a -> b -> ... -> a`, to print in a failure."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        following = sorted(d for d in graph[path[-1]] if d in members)
        back = start if start in following else None
        if back and len(path) > 1:
            return " -> ".join([*path, start])
        fresh = [d for d in following if d not in seen]
        if not fresh:
            return " -> ".join([*path, following[0]]) + " (...)"
        path.append(fresh[0])
        seen.add(fresh[0])


def _unexpected(graph: dict[str, set[str]], known: set[frozenset[str]]) -> list[str]:
    return [f"{cycle_path(c, graph)}   (all of: {', '.join(c)})"
            for c in circles(graph) if frozenset(c) not in known]


def test_no_import_circle_between_files():
    graph = import_graph()
    unexpected = _unexpected(graph, KNOWN_FILE_CIRCLES)
    assert not unexpected, "import circles between files:\n" + "\n".join(unexpected)


def test_no_import_circle_between_folders():
    graph = folder_graph(import_graph())
    unexpected = _unexpected(graph, KNOWN_FOLDER_CIRCLES)
    assert not unexpected, "import circles between folders:\n" + "\n".join(unexpected)


def test_the_engine_imports_nothing_above_it():
    """comm/ is the engine: it takes what it needs from `td.init` (comm/context.py)."""
    graph = import_graph()
    above = ("tandem.runtime", "tandem.diagnostics", "tandem.parallel", "tandem.data",
             "tandem.checkpoint", "tandem.launch", "tandem.bench")
    wrong = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith("tandem.comm")
                   for d in deps if d.startswith(above) or d == "tandem")
    assert not wrong, "comm/ imports from above it:\n" + "\n".join(wrong)


def test_the_guard_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert cycle_path(["a", "b", "c"], graph) == "a -> b -> c -> a"


def test_a_gradient_bucket_crosses_six_files_to_the_wire():
    """reducer -> hook -> watchdog -> engine -> watchdog -> hook -> reducer: the backend is the
    reducer's own (no global look-up per bucket), and the watchdog counts in the wrapper's file."""
    import os
    import sys

    import torch

    import tandem as td
    from tandem import runtime
    from tandem.comm.watchdog.watched import Ledger, WatchedBackend
    from tandem.parallel.data_parallel.reducer import Reducer

    td.init(backend="gloo")
    try:
        state = runtime.state()
        state.backend = WatchedBackend(state.backend, Ledger(0, 1, 300.0))  # as in a larger world
        model = torch.nn.Linear(4, 2)
        reducer = Reducer(list(model.named_parameters()), cap_bytes=1 << 20, first_cap_bytes=1 << 20)
        package = os.path.dirname(td.__file__) + os.sep
        files: list[str] = []

        def follow(frame, event, _):
            if event == "return":
                frame = frame.f_back
            if event in ("call", "return") and frame is not None:
                name = frame.f_code.co_filename
                if name.startswith(package) and (not files or files[-1] != name[len(package):]):
                    files.append(name[len(package):])

        sys.setprofile(follow)
        try:
            reducer._launch(0)
        finally:
            sys.setprofile(None)
        reducer._works[0].wait()
    finally:
        td.shutdown()
    names = [name.replace(os.sep, "/") for name in files]
    assert names == ["parallel/data_parallel/reducer.py", "parallel/data_parallel/comm_hooks.py",
                     "comm/watchdog/watched.py",
                     "comm/engines/torch_backend.py", "comm/watchdog/watched.py",
                     "parallel/data_parallel/comm_hooks.py",
                     "parallel/data_parallel/reducer.py"], names


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's contracts of pyproject.toml (DESIGN §10) over the package under `root`."""
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    return subprocess.run([str(lint), "--no-cache", str(ROOT / "pyproject.toml")], cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_layers_contract_holds():
    """Each layer imports only from the layers below it; the launcher starts without torch."""
    done = _lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_layers_contract_fails_on_a_planted_upward_import(tmp_path):
    shutil.copytree(SRC / "tandem", tmp_path / "src" / "tandem",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "src" / "tandem" / "comm" / "planted.py").write_text("import tandem.checkpoint\n")
    done = _lint_imports(tmp_path)
    assert done.returncode != 0
    assert "tandem.comm is not allowed to import tandem.checkpoint" in done.stdout, done.stdout


def private_reach_ins() -> list[str]:
    """`from tandem.x import _name` and `module._name` for a tandem module: another module's
    private names, read from outside it."""
    found = []
    for module, tree in _trees().items():
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and ((node.module or "").startswith("tandem")
                                                     or node.level):
                for alias in node.names:
                    if _private(alias.name):
                        found.append(f"{module}:{node.lineno} imports {alias.name}")
                    imported.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                imported |= {(a.asname or a.name).split(".")[0] for a in node.names
                             if a.name.startswith("tandem")}
        found += [f"{module}:{node.lineno} reads {node.value.id}.{node.attr}"
                  for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and _private(node.attr)
                  and isinstance(node.value, ast.Name) and node.value.id in imported]
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_reads_another_modules_private_names():
    reach_ins = [r for r in private_reach_ins() if r.split(" ", 1)[0].rsplit(":", 1)[0]
                 not in KNOWN_PRIVATE_READERS]
    assert not reach_ins, "make these names public, or move the code to their module:\n" + \
        "\n".join(reach_ins)
