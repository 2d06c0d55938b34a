"""The import rules of docs/ARCHITECTURE.md, read from the source (an AST walk: imports inside
functions and under TYPE_CHECKING count too): no circle between modules, and each layer imports
only its own and the layers below it. The layers, bottom up: the shared leaves (errors, device,
policy, text), format/ (what the runtime reads), kernels/ (the CUDA kernels' Python side: what
the runtime launches; it never imports the runtime), runtime/, build/ (offline: it may drive the
engine), bench/, commands/, the CLI."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pwctl"
# above the shared leaves, bottom up
LAYERS = ("format", "kernels", "runtime", "build", "bench", "commands", "cli")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """pwctl modules `path` imports: `from a import b` names a.b where that is a module."""
    known, found = _modules(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = {f"{node.module}.{a.name}" for a in node.names}
            found |= (subs & known.keys()) or {node.module}
    return {m for m in found if m in known}


@cache
def _graph() -> dict[str, set[str]]:
    return {name: _imports(path) for name, path in _modules().items()}


def _layer(module: str) -> int:
    """0 for the shared leaves, else 1 + the index of its layer in LAYERS."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    return LAYERS.index(top) + 1 if top in LAYERS else 0


def test_no_import_circles():
    graph, state, circles = _graph(), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                circles.append(" -> ".join(path[path.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_layers_import_only_downward():
    """The runtime never imports build code; commands, bench and the CLI sit above the runtime
    and nothing below imports them."""
    wrong = [
        f"{module} ({LAYERS[_layer(module) - 1] if _layer(module) else 'shared'}) imports {dep}"
        for module, deps in sorted(_graph().items())
        for dep in sorted(deps)
        if _layer(dep) > _layer(module)
    ]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_walk_sees_every_kind_of_import():
    """The rules are only as good as the walk: it finds imports in function bodies and under
    TYPE_CHECKING, and reads `from package import module` as the module."""
    graph = _graph()
    assert "pwctl.runtime.engine.engine" in graph["pwctl.build.profile"]  # TYPE_CHECKING
    assert "pwctl.bench.throughput" in graph["pwctl.commands.bench_modes.throughput"]  # in a body
    assert "pwctl.kernels.launch" in graph["pwctl.runtime.moe.fused"]  # from pwctl.kernels import
    assert _layer("pwctl.errors") == 0 < _layer("pwctl.format.pack") < _layer("pwctl.cli")
    assert _layer("pwctl.format.pack") < _layer("pwctl.kernels.launch") < _layer("pwctl.runtime")
