"""Kernels by name end to end: no Triton kernel or helper of the package reads a group of
values by position.

A constexpr tuple read by index (``MODE[6]``) or a group of runtime values unpacked by
position (``a, b, c = group``) compiles whatever order its builder used: a swapped pair
shows only in the numbers. The kernels build named tuples (``typing.NamedTuple``) and the
helpers read them by attribute; per-call tensors are bound by parameter name
(``tests/test_launch.py``). Named tuples are built by keyword, and helpers of more than
4 parameters called by keyword, so that swapping two arguments of the same kind is a
compile error, not a wrong number. This walks every ``@triton.jit`` function's source
with ``ast``.
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


def named_tuples() -> set[str]:
    """The names of the NamedTuple classes the backends define (the kernels' groups)."""
    return {node.name for path in sorted(BACKENDS.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
            and any(ast.unparse(base).endswith("NamedTuple") for base in node.bases)}


def positional_calls(fn: ast.FunctionDef, groups: set[str], helpers: dict[str, int]) -> list[str]:
    """Each call in ``fn`` that passes by position what should go by name: a named tuple of
    ``groups`` built with any positional argument, a helper of ``helpers`` (name ->
    parameter count) of more than 4 parameters called with any."""
    found = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and node.args:
            name = ast.unparse(node.func).rsplit(".", 1)[-1]
            if name in groups or helpers.get(name, 0) > 4:
                found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


GROUPS = named_tuples()
HELPERS = {fn.name: len(fn.args.args) for _, fn in FUNCTIONS}


def test_the_walk_finds_the_kernels():
    names = {name.split(":")[1] for name, _ in FUNCTIONS}
    assert {"draft_attention_kernel", "merge_segments_kernel", "context_kv_kernel", "_attend", "_epilogue",
            "_store_cols", "_merge_rows"} <= names


@pytest.mark.parametrize("name,fn", FUNCTIONS, ids=[name for name, _ in FUNCTIONS])
def test_no_kernel_or_helper_reads_a_group_by_position(name, fn):
    assert positional_reads(fn) == [], f"{name} reads by position; build a NamedTuple and read it by attribute"


@pytest.mark.parametrize("name,fn", FUNCTIONS, ids=[name for name, _ in FUNCTIONS])
def test_groups_are_built_and_helpers_called_by_name(name, fn):
    assert positional_calls(fn, GROUPS, HELPERS) == [], f"{name}: pass these by keyword"


@pytest.mark.parametrize("source,found", [
    ("def f(a):\n    AttendMode(True, False)\n", True),
    ("def f(a):\n    _attend(a, a, a, a, a)\n", True),
    ("def f(a):\n    AttendMode(CAUSAL=True)\n    _attend(acc=a, m_i=a, l_i=a, query=a, table=a)\n    _f(a, a)\n",
     False),
], ids=["group", "helper", "by-name"])
def test_the_walk_sees_a_positional_call(source, found):
    assert bool(positional_calls(ast.parse(source).body[0], {"AttendMode"}, {"_attend": 11, "_f": 2})) is found


@pytest.mark.parametrize("source,found", [
    ("def f(MODE):\n    X: tl.constexpr = MODE[6]\n", True),
    ("def f(cache):\n    a, b = cache\n", True),
    ("def f(x):\n    a, b = g(x)\n    return x[:, None] + MODE.BLOCK\n", False),
], ids=["index", "unpack", "by-name"])
def test_the_walk_sees_a_positional_read(source, found):
    assert bool(positional_reads(ast.parse(source).body[0])) is found
