"""The floor plan, checked: no import circle, and no import runs from a lower floor to a higher.

Every `import` in the tree counts, function-level ones too (a lazy import is still an arrow).
Floors, lowest first: `contracts` (imports nothing of ours); the training side (`worker`,
`megatron_runs`), which sees only `contracts`; then the supervisor's parts as listed in
`SUPERVISOR_FLOORS`. A part may import its own floor's parts only where the arrow keeps the
package graph free of circles.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUR_PACKAGES = ("contracts", "worker", "megatron_runs", "supervisor")

#: The supervisor's parts by floor, lowest first; a part is a module or subpackage of
#: `supervisor` (its first dotted component after `supervisor.`).
SUPERVISOR_FLOORS: tuple[frozenset[str], ...] = (
    frozenset({"models", "db", "settings", "auth", "metrics", "roots", "layout", "alert_routing"}),
    frozenset({"store", "slurm", "metrics_in", "accounting", "launcher"}),
    frozenset({"watchdog", "report", "report_plot", "preview", "service", "run_logs", "smoke"}),
    frozenset({"api"}),
    frozenset({"cli"}),
)


def _modules() -> dict[str, Path]:
    found = {}
    for package in OUR_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module → the modules of ours it imports (an imported name that is a module counts)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    edges[name].add(target)
    return edges


def _part(module: str) -> str:
    """`supervisor.watchdog.policy` → `supervisor.watchdog`; `worker.task` → `worker`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "supervisor" and len(parts) > 1 else parts[0]


def _floor(part: str) -> int:
    if part == "contracts":
        return 0
    if part in ("worker", "megatron_runs"):
        return 1
    name = part.removeprefix("supervisor.")
    for floor, parts in enumerate(SUPERVISOR_FLOORS, start=2):
        if name in parts:
            return floor
    raise AssertionError(f"{part} has no floor: add it to SUPERVISOR_FLOORS")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _part_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    parts: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            if _part(a) != _part(b) and _part(b) != "supervisor":
                parts[_part(a)].add(_part(b))
    return parts


def test_no_module_imports_in_a_circle() -> None:
    assert _cycles(_imports(_modules())) == []


def test_no_part_imports_in_a_circle() -> None:
    assert _cycles(_part_edges(_imports(_modules()))) == []


def test_no_import_runs_up_a_floor() -> None:
    upward = sorted(
        f"{a} → {b}"
        for a, targets in _part_edges(_imports(_modules())).items()
        for b in targets
        if _floor(b) > _floor(a)
    )
    assert upward == []


def test_contracts_import_nothing_of_ours_and_training_sees_only_contracts() -> None:
    parts = _part_edges(_imports(_modules()))
    assert parts.get("contracts", set()) == set()
    assert parts.get("worker", set()) <= {"contracts"}
    assert parts.get("megatron_runs", set()) <= {"contracts"}


def test_the_checker_sees_a_planted_circle_and_an_upward_import() -> None:
    edges = {"supervisor.store": {"supervisor.api.app"}, "supervisor.api.app": {"supervisor.store"}}
    assert _cycles(edges) == [["supervisor.api.app", "supervisor.store"]]
    assert _floor(_part("supervisor.api.app")) > _floor(_part("supervisor.store"))
