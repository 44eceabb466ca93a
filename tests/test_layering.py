"""The package's layering (issue #19): no import cycles, no upward imports, no slot folder importing another.

Every module of ``lightning_dp/`` is parsed with ``ast`` (nothing is imported), and every import of a
``lightning_dp`` module counts: top-level, inside a function, or under ``TYPE_CHECKING`` (a lazy import
hides a dependency, it does not remove it). ``FLOORS`` places each file by its path, bottom to top.
``ALLOWED_*`` are empty: the package has no cycle and no upward import. An entry may name a known
violation during a move, one by one; a stale entry fails, so the lists only shrink.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_dp"

# The modules kept at the root for users' imports, each re-exporting its new home (issue #52).
ALIASES = (
    "audit.py",
    "callbacks.py",
    "checkpointing.py",
    "cli.py",
    "errors.py",
    "losses.py",
    "release.py",
    "tuning.py",
    "validation.py",
)

# Bottom to top, one folder a floor. A key ending in "/" holds a whole folder; the longest matching key places
# a file. Each root module is an alias kept for users' imports (ALIASES): on the top floor, imported by none.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("core/",)),
    ("accounting", ("accounting/",)),
    ("per_example", ("per_example/",)),
    ("slots", ("slots/",)),
    # the four slot folders (one floor; none imports another, see SLOT_FOLDERS)
    ("slot folders", ("sampling/", "clipping/", "noise/", "steps/")),
    ("engine", ("engine/",)),
    ("checks", ("checks/",)),
    # what a fit prepares and leaves: the module made trainable, the callback, the report, checkpoint files
    ("run", ("run/",)),
    ("strategies", ("strategies/",)),
    ("top", ("commands/", "__init__.py", *ALIASES)),
]
SLOT_FOLDERS = ("sampling/", "clipping/", "noise/", "steps/")

# Known upward and slot-to-slot imports, as (importer, imported), paths under lightning_dp/ (none today).
ALLOWED_UPWARD: set[tuple[str, str]] = set()
# Known cycles on one floor, each named by one import that closes it (none today).
ALLOWED_CYCLE_EDGES: set[tuple[str, str]] = set()


def _module_files() -> dict[str, str]:
    """Dotted module name (``lightning_dp.x.y``) -> path relative to the package (``x/y.py``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        parts = ["lightning_dp", *Path(rel).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = rel
    return out


def _imports(module: str, rel: str, modules: dict[str, str]) -> Iterator[str]:
    """The ``lightning_dp`` modules that ``module`` imports: ``from pkg import sub`` names the
    submodule, ``from pkg import Name`` the package's ``__init__``."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    package = module if rel.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(ast.parse((PACKAGE / rel).read_text(), filename=rel)):
        if isinstance(node, ast.Import):
            targets = [known(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            sub = [f"{source}.{alias.name}" for alias in node.names]
            targets = [name if name in modules else known(source) for name in sub]
        else:
            continue
        yield from (t for t in targets if t is not None and t != module)


def import_graph() -> dict[str, set[str]]:
    """File -> the files it imports, both relative to ``lightning_dp/``."""
    modules = _module_files()
    return {rel: {modules[t] for t in _imports(m, rel, modules)} for m, rel in modules.items()}


def floor_of(rel: str) -> tuple[int, str]:
    """(index, key) of the longest FLOORS key that places ``rel``; an unplaced file is an error."""
    best: tuple[int, int, str] | None = None
    for index, (_, keys) in enumerate(FLOORS):
        for key in keys:
            if (rel == key or (key.endswith("/") and rel.startswith(key))) and (
                best is None or len(key) > best[1]
            ):
                best = (index, len(key), key)
    assert best is not None, f"{rel} has no floor: add it (or its folder) to FLOORS in tests/test_layering.py"
    return best[0], best[2]


def layering_violations(graph: dict[str, set[str]]) -> dict[tuple[str, str], str]:
    """Each upward or slot-to-slot import, with its message."""
    found = {}
    for importer, imported in sorted((a, b) for a, targets in graph.items() for b in targets):
        (low, low_key), (high, high_key) = floor_of(importer), floor_of(imported)
        if high > low:
            found[importer, imported] = (
                f"{importer} imports {imported} (floor {FLOORS[high][0]} above floor {FLOORS[low][0]})"
            )
        elif low_key != high_key and {low_key, high_key} <= set(SLOT_FOLDERS):
            found[importer, imported] = (
                f"{importer} imports {imported} (slot folder {high_key} beside {low_key})"
            )
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components with more than one file (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def test_no_upward_imports() -> None:
    found = layering_violations(import_graph())
    new = [message for edge, message in found.items() if edge not in ALLOWED_UPWARD]
    stale = sorted(ALLOWED_UPWARD - found.keys())
    assert not new, "upward imports (move the code down, or pass what it needs in):\n" + "\n".join(new)
    assert not stale, f"ALLOWED_UPWARD names imports that are gone, remove them: {stale}"


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            if nxt == goal:
                return True
            seen.add(nxt)
            todo.append(nxt)
    return start == goal


def test_no_import_cycles() -> None:
    graph = import_graph()
    allowed = ALLOWED_UPWARD | ALLOWED_CYCLE_EDGES
    rest = {a: {b for b in targets if (a, b) not in allowed} for a, targets in graph.items()}
    new = [
        " <-> ".join(component)
        + "\n    "
        + "\n    ".join(f"{a} imports {b}" for a in component for b in sorted(rest[a] & set(component)))
        for component in import_cycles(rest)
    ]
    stale = sorted(
        (a, b) for a, b in ALLOWED_CYCLE_EDGES if b not in graph.get(a, ()) or not _reaches(graph, b, a)
    )
    assert not new, "import cycles (break one import of each):\n" + "\n".join(new)
    assert not stale, f"ALLOWED_CYCLE_EDGES names imports that no longer close a cycle, remove them: {stale}"


def test_the_checks_see_a_cycle_an_upward_import_and_a_slot_import() -> None:
    graph = {
        "core/errors.py": {"engine/step.py"},
        "engine/step.py": {"slots/contract.py"},
        "slots/contract.py": {"core/errors.py"},
        "clipping/flat.py": {"noise/constant.py"},
        "noise/constant.py": set(),
    }
    assert import_cycles(graph) == [("core/errors.py", "engine/step.py", "slots/contract.py")]
    assert layering_violations(graph) == {
        (
            "core/errors.py",
            "engine/step.py",
        ): "core/errors.py imports engine/step.py (floor engine above floor core)",
        ("clipping/flat.py", "noise/constant.py"): (
            "clipping/flat.py imports noise/constant.py (slot folder noise/ beside clipping/)"
        ),
    }


def test_the_root_holds_the_api_and_aliases() -> None:
    """A module at the root is the package's face or an alias: new code goes to its floor's folder."""
    root = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert root == sorted(["__init__.py", *ALIASES]), "place a new module in its floor's folder"


def test_aliases_only_re_export_and_nothing_imports_them() -> None:
    """An alias imports one module, its new home, and says so; the package imports the new homes (the face
    keeps ``lightning_dp.audit`` the function by loading that alias first)."""
    graph = import_graph()
    for alias in ALIASES:
        tree = ast.parse((PACKAGE / alias).read_text())
        assert (ast.get_docstring(tree) or "").startswith("Kept for users' imports: re-exports"), alias
        assert len(graph[alias]) == 1, f"{alias} imports {sorted(graph[alias])}: an alias re-exports one home"
        users = sorted(a for a, targets in graph.items() if alias in targets and a != "__init__.py")
        assert not users, f"{users} import the alias {alias}: import its new home {sorted(graph[alias])}"
    assert {b for b in graph["__init__.py"] if b in ALIASES} == {"audit.py"}


def test_every_package_says_its_floor() -> None:
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init.parent.name}/ needs a docstring"
