"""The package's import graph: contract types at the bottom, CLI and integrations at the
top, no cycles, and tools that talk to backends only through their hooks.

Every import counts, function-local ones included: a cycle held together by a lazy
import is still a cycle. Modules are read with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"dflash_rocm": ROOT / "dflash_rocm", "dflash_rocm.backends": ROOT / "backends"}

# Lowest first. A module may import from its own layer and the layers below it.
LAYERS: list[tuple[str, ...]] = [
    ("dflash_rocm.contract", "dflash_rocm.version", "dflash_rocm.envs", "dflash_rocm.launches", "dflash_rocm.capture",
     "dflash_rocm.timing", "dflash_rocm.report", "dflash_rocm.rope", "dflash_rocm.paged",
     "dflash_rocm.backend_names"),
    ("dflash_rocm.arch", "dflash_rocm.weights", "dflash_rocm.tuning", "dflash_rocm.process"),
    ("dflash_rocm.derived",),  # refuses weights resized since they were built
    ("dflash_rocm.platform", "dflash_rocm.planning", "dflash_rocm.validation", "dflash_rocm.checkpoint"),
    ("dflash_rocm.ops",),
    ("dflash_rocm.backend", "dflash_rocm.registry", "dflash_rocm.dispatch", "dflash_rocm.floors",
     "dflash_rocm.unfused"),
    ("dflash_rocm.backends",),
    ("dflash_rocm.api", "dflash_rocm.plan", "dflash_rocm", "dflash_rocm.workloads"),
    ("dflash_rocm.check", "dflash_rocm.bench", "dflash_rocm.info", "dflash_rocm.cli", "dflash_rocm.__main__",
     "dflash_rocm.vllm_plugin", "dflash_rocm.audit", "dflash_rocm.peer", "dflash_rocm.host_bench",
     "dflash_rocm.vllm_bench", "dflash_rocm.vllm_cpu_attention", "dflash_rocm.tiny_models",
     "dflash_rocm.assumptions_bench", "dflash_rocm.probe_kernels", "dflash_rocm.gpu_report"),
]
# Tools above the backends that may read backend internals: the compiled-kernel audit
# exists to look inside the Triton kernels, and bench --assumptions times the Triton
# precompute under the launch configs the audit models. Everyone else goes through Backend hooks.
MAY_IMPORT_BACKEND_INTERNALS = ("dflash_rocm.audit", "dflash_rocm.assumptions_bench")


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if is_package(path) else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in known else base)
    return {t for t in targets if t == "dflash_rocm" or t.startswith("dflash_rocm.")}


def layer_of(name: str) -> int:
    best = None
    for i, members in enumerate(LAYERS):
        for m in members:
            if name == m or name.startswith(m + "."):
                if best is None or len(m) > len(best[1]):
                    best = (i, m)
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best[0]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {t for t in imports_of(name, path, known) if t != name} for name, path in known.items()}


def test_every_import_points_down_or_sideways():
    wrong = []
    for name, targets in graph().items():
        for target in targets:
            if layer_of(target) > layer_of(name):
                wrong.append(f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    # A package's __init__ importing its own submodules is how packages work, not a cycle.
    real = [c for c in cycles if not all(a == b or b.startswith(a + ".") or a.startswith(b + ".")
                                         for a, b in zip(c, c[1:]))]
    assert not real, "\n".join(" -> ".join(c) for c in real)


def test_tools_reach_backends_through_hooks_only():
    tools = LAYERS[-1]
    wrong = []
    for name, targets in graph().items():
        if layer_of(name) != len(LAYERS) - 1 or name.startswith(MAY_IMPORT_BACKEND_INTERNALS):
            continue
        wrong += [f"{name} imports {t}" for t in targets if t.startswith("dflash_rocm.backends")]
    assert tools and not wrong, "\n".join(wrong)


def test_the_graph_is_read_correctly():
    """The reader resolves relative, absolute and function-local imports (else the tests
    above would pass vacuously)."""
    edges = graph()
    assert "dflash_rocm.ops.attention.call" in edges["dflash_rocm.ops.attention"]  # relative
    assert "dflash_rocm.backend" in edges["dflash_rocm.backends.triton"]  # absolute, from the backends folder
    assert "dflash_rocm.check" in edges["dflash_rocm.cli"]  # function-local
