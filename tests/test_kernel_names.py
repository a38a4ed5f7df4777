"""Kernels by name end to end: no Triton kernel or helper of the package reads a group of
values by position.

A constexpr tuple read by index (``MODE[6]``) or a group of runtime values unpacked by
position (``a, b, c = group``) compiles whatever order its builder used: a swapped pair
shows only in the numbers. The kernels build named tuples (``typing.NamedTuple``) and the
helpers read them by attribute; per-call tensors are bound by parameter name
(``tests/test_launch.py``). This walks every ``@triton.jit`` function's source with
``ast``.
"""

import ast
from pathlib import Path

import pytest

BACKENDS = Path(__file__).resolve().parent.parent / "backends"


def jit_functions() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(BACKENDS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                found.append((f"{path.relative_to(BACKENDS)}:{node.name}", node))
    return found


def positional_reads(fn: ast.FunctionDef) -> list[str]:
    """Each read of a value by position in ``fn``: a subscript by an integer constant, or
    a tuple target unpacking one of ``fn``'s parameters (or a name it assigned) rather
    than a call's results."""
    reads = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Subscript):
            index = node.slice
            if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub):
                index = index.operand
            if isinstance(index, ast.Constant) and type(index.value) is int:
                reads.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            if any(isinstance(t, ast.Tuple) for t in node.targets):
                reads.append(f"line {node.lineno}: {ast.unparse(node)}")
    return reads


FUNCTIONS = jit_functions()


def test_the_walk_finds_the_kernels():
    names = {name.split(":")[1] for name, _ in FUNCTIONS}
    assert {"draft_attention_kernel", "merge_segments_kernel", "context_kv_kernel", "_attend", "_epilogue",
            "_store_cols", "_merge_rows"} <= names


@pytest.mark.parametrize("name,fn", FUNCTIONS, ids=[name for name, _ in FUNCTIONS])
def test_no_kernel_or_helper_reads_a_group_by_position(name, fn):
    assert positional_reads(fn) == [], f"{name} reads by position; build a NamedTuple and read it by attribute"


@pytest.mark.parametrize("source,found", [
    ("def f(MODE):\n    X: tl.constexpr = MODE[6]\n", True),
    ("def f(cache):\n    a, b = cache\n", True),
    ("def f(x):\n    a, b = g(x)\n    return x[:, None] + MODE.BLOCK\n", False),
], ids=["index", "unpack", "by-name"])
def test_the_walk_sees_a_positional_read(source, found):
    assert bool(positional_reads(ast.parse(source).body[0])) is found
