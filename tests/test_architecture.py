"""The package tree is the pipeline: no import circles, imports only down the stages, one door per stage.

Read from the source with ``ast`` (nothing is imported): every ``import`` and ``from ... import`` of a
``lightning_sac`` module, at any depth of a module (inside functions and ``if TYPE_CHECKING:`` blocks too: an
annotation names a stage as much as a call does). The stage order is docs/architecture.md's.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_sac"

# Low to high: a module may import its own stage and the stages before it, never one after.
STAGES = (
    "errors",
    "devices",
    "ops",
    "adapters",
    "sharding",
    "dryrun",
    "plan",
    "solver",
    "apply",
    "profiling",
    "report",
    "lightning",
    "integrations",
    "cli",
    "demos",
    "__init__",
    "__main__",
)


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _stage(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _resolve(name: str) -> str:
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every lightning_sac import in ``module``; ``from pkg import sub`` names sub."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(_resolve(a.name), node.lineno) for a in node.names if a.name.startswith("lightning_sac")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lightning_sac"):
            assert node.module is not None
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
            out += [(s, node.lineno) for s in subs] or [(_resolve(node.module), node.lineno)]
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{module}:{node.lineno}: relative import; the package imports absolutely")
    # A module's own ancestors (its package's door) run first anyway: they are not a dependency of the module.
    return [(m, line) for m, line in out if m != module and not module.startswith(m + ".")]


EDGES = {m: _imports(m) for m in MODULES}


def test_every_module_belongs_to_a_stage():
    assert {_stage(m) for m in MODULES} <= set(STAGES), sorted({_stage(m) for m in MODULES} - set(STAGES))


def test_no_module_imports_a_later_stage():
    rank = {s: i for i, s in enumerate(STAGES)}
    upward = [
        f"{m}:{line} ({_stage(m)}) imports {t} ({_stage(t)})"
        for m, targets in EDGES.items()
        for t, line in targets
        if rank[_stage(t)] > rank[_stage(m)]
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    graph = {m: {t for t, _ in targets} for m, targets in EDGES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_other_stages_import_a_stage_through_its_door():
    # lightning_sac.<stage> is the door; its modules are the stage's own business.
    private = [
        f"{m}:{line} imports {t}"
        for m, targets in EDGES.items()
        for t, line in targets
        if _stage(t) != _stage(m) and t.count(".") > 1 and _stage(m) not in ("__init__", "__main__")
    ]
    assert not private, "\n".join(private)


def test_the_tree_stays_small():
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= 6, top
    per_package = collections.Counter(p.parent for p in PACKAGE.rglob("*.py"))
    crowded = {str(d.relative_to(PACKAGE.parent)): n for d, n in per_package.items() if n > 12}
    assert not crowded, crowded
    lines = {_name(p): len(p.read_text(encoding="utf-8").splitlines()) for p in PACKAGE.rglob("*.py")}
    assert not {m: n for m, n in lines.items() if n > 350}
    shims = [
        m
        for m, p in MODULES.items()
        if lines[m] < 40 and p.name != "__init__.py" and _only_reexports(ast.parse(p.read_text(encoding="utf-8")))
    ]
    assert not shims, shims


def _only_reexports(tree: ast.Module) -> bool:
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return all(isinstance(n, (ast.Import, ast.ImportFrom, ast.Assign)) for n in body)


PUBLIC_API = [
    "AutoSAC",
    "BudgetError",
    "DeviceSpec",
    "LightningSACError",
    "ModelProfile",
    "ModuleDecision",
    "ModuleOpStats",
    "ModuleProfile",
    "Plan",
    "PlanHandle",
    "ProfilingError",
    "UnknownDeviceError",
    "apply_plan",
    "get_device_spec",
    "greedy_op_policy",
    "host_read_stand_ins",
    "known_devices",
    "optimal_op_policy",
    "profile_model",
    "profile_step",
    "render_profile",
    "solve_plan",
]


def test_the_public_api_is_exactly_these_names_and_each_imports():
    import lightning_sac

    assert sorted(lightning_sac.__all__) == PUBLIC_API
    for name in PUBLIC_API:
        value = getattr(lightning_sac, name)
        assert getattr(value, "__name__", name) == name  # the object itself, not a module of that name
    assert dir(lightning_sac) == PUBLIC_API
