"""What the docs name exists in the code, so a rename that forgets a doc fails here.

Checked in ``README.md``, ``docs/*.md``, ``backends/README.md`` and the Dockerfiles' comments:

- every ``dflash_rocm.*`` dotted name (anywhere, and the names a Python block imports from
  ``dflash_rocm``) imports and resolves, attribute by attribute;
- every code span ``A.b`` whose first part is one of ours (a module's last name, a public
  class defined in our code, or an object name of ``OBJECTS``) resolves (a file name such as
  ``arch.py`` is not a dotted name);
- every code span ``f(...)`` names a function, method or class defined in our code (or a
  ``math`` or ``torch`` function: formulas such as ``mean(x^2)``), except in
  ``docs/vllm*.md``, whose calls are vLLM's own methods;
- every repository path (a word starting with one of our top-level folders, ``<...>`` taken
  as a wildcard) and every relative link target exists;
- every ``DFLASH_ROCM_*`` variable is one ``dflash_rocm.envs`` defines;
- every ``dflash-rocm COMMAND --option`` in code names a command and option the CLI has;
- every vLLM image named is a Dockerfile's default base image, or, after ``BASE_IMAGE=``, one
  whose vLLM the plugin supports.

What is not ours is excluded by rule, not by list: a path counts only when it starts (not
after a ``/``) with one of our top-level folders, so vLLM's ``v1/attention/...`` and
``vllm/...`` paths never match; dotted names count only when they start with
``dflash_rocm`` or with one of our names, so ``vllm.*``, ``torch.*`` never match. The two
lists below are the only exceptions, both small.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import math
import re
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from dflash_rocm import envs
from dflash_rocm.cli import build_parser
from dflash_rocm.vllm_plugin.compat import SUPPORTED
from dockerfiles import DOCKERFILES, base_image, image_version

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "backends" / "README.md", *(ROOT / "docs").glob("*.md"), *DOCKERFILES])
SOURCE_ROOTS = {"dflash_rocm": ROOT / "dflash_rocm", "dflash_rocm.backends": ROOT / "backends"}

EXAMPLE_NAMES = {"mine"}
"""Names a doc makes up for an example (backends/README.md's backend ``mine``): a name or path
with one of these as a part is illustrative."""

OBJECTS = {
    "call": ("dflash_rocm.ops.attention.AttentionCall", "dflash_rocm.ops.precompute.PrecomputeCall"),
    "plan": ("dflash_rocm.plan.DraftAttentionPlan", "dflash_rocm.plan.ContextKVPlan"),
}
"""What the docs' object names stand for (``call.out``, ``plan.run``): resolved against these
classes, never as the module of the same name."""


# --- what is ours ------------------------------------------------------------------------

@lru_cache(maxsize=1)
def module_files() -> dict[str, Path]:
    """Every module of ours by dotted name (a nested root, ``dflash_rocm.backends``, wins)."""
    out: dict[str, Path] = {}
    for name, folder in SOURCE_ROOTS.items():
        for source in sorted(folder.rglob("*.py")):
            rel = source.relative_to(folder).with_suffix("").parts
            if "__pycache__" in rel:
                continue
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            out[".".join((name, *parts))] = source
    return out


@lru_cache(maxsize=1)
def our_names() -> dict[str, tuple[str, ...]]:
    """First parts of a dotted name that are ours -> the dotted prefixes they stand for: every
    module's last name, and every public class defined at a module's top (not functions: a
    doc's ``attention_config.x`` is vLLM's config, not our function of that name)."""
    found: dict[str, set[str]] = {}
    for module, source in module_files().items():
        found.setdefault(module.rpartition(".")[2], set()).add(module)
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found.setdefault(node.name, set()).add(f"{module}.{node.name}")
    for name, targets in OBJECTS.items():
        found[name] = set(targets)
    return {name: tuple(sorted(prefixes)) for name, prefixes in found.items()}


@lru_cache(maxsize=1)
def top_level_folders() -> tuple[str, ...]:
    """The repository's own top-level folders (hidden ones and build outputs left out)."""
    ignored = [line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    return tuple(sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
                        and not any(Path(p.name).match(pattern) for pattern in ignored)))


def has_field(obj, name: str) -> bool:
    """``name`` is a dataclass field or an annotated attribute of ``obj``'s class (which has no
    class attribute when it has no default)."""
    classes = obj.__mro__ if isinstance(obj, type) else type(obj).__mro__
    return any(name in getattr(cls, "__dataclass_fields__", {}) or name in getattr(cls, "__annotations__", {})
               for cls in classes)


@lru_cache(maxsize=None)
def resolves(dotted: str) -> bool:
    """``dotted`` is a module of ours, or a chain of attributes from one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        if module_name not in module_files():
            continue
        obj = importlib.import_module(module_name)
        for attribute in parts[cut:]:
            if isinstance(obj, type(importlib)) and f"{obj.__name__}.{attribute}" in module_files():
                obj = importlib.import_module(f"{obj.__name__}.{attribute}")
            elif hasattr(obj, attribute):
                obj = getattr(obj, attribute)
            else:
                return has_field(obj, attribute)  # a field without a default: nothing past it to follow
        return True
    return False


# --- what a doc names --------------------------------------------------------------------

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"(?<![\w.])dflash_rocm(?:\.\w+)+")
FROM_IMPORT = re.compile(r"^[ \t]*from[ \t]+(dflash_rocm(?:\.\w+)*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]+)", re.M)
FILE_NAME = re.compile(r".*\.(py|md|json|toml|txt|csv|sh|hpp|cpp|cu|yaml|yml|whl|safetensors)")
QUALIFIED = re.compile(r"([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)(?:\(.*\))?")
LINK = re.compile(r"\]\(([^)\s]+)\)")
ENV = re.compile(r"(?<!\w)DFLASH_ROCM_[A-Z0-9_]+")
IMAGE = re.compile(r"(BASE_IMAGE=)?(?<![\w/.-])(vllm/[\w.-]+:v\d+\.\d+\.\d+)")
COMMAND = re.compile(r"(?:^|`|&&|\|\||;)\s*dflash-rocm\s+([^`&|;\n]*)", re.M)


def path_pattern() -> re.Pattern:
    folders = "|".join(re.escape(name) for name in top_level_folders())
    return re.compile(rf"(?<![\w./<>-])((?:{folders})/[\w./<>*-]*)")


def code_parts(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The fenced blocks ``(language, body)``, and the inline code spans outside them."""
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]
    return blocks, CODE_SPAN.findall(FENCE.sub("", text))


def is_example(name: str) -> bool:
    return any(part in EXAMPLE_NAMES for part in re.split(r"[./]", name))


def dotted_problems(text: str) -> list[str]:
    blocks, spans = code_parts(text)
    names = set(DOTTED.findall(text))
    for _, body in blocks:
        for module, imported in FROM_IMPORT.findall(body):
            imported = re.sub(r"\s+as\s+\w+", "", imported)
            names |= {f"{module}.{word}" for word in re.split(r"[\s,()]+", imported) if word}
    problems = [f"{name}: no such module or attribute" for name in sorted(names)
                if not is_example(name) and not resolves(name)]
    for span in spans:
        match = QUALIFIED.fullmatch(span.strip())
        if (not match or FILE_NAME.fullmatch(span.strip()) or match.group(1) == "dflash_rocm"
                or match.group(1) not in our_names()):
            continue
        candidates = [prefix + match.group(2) for prefix in our_names()[match.group(1)]]
        if not any(resolves(candidate) for candidate in candidates):
            problems.append(f"{span}: none of {', '.join(candidates)} exists")
    return problems


@lru_cache(maxsize=1)
def defined_names() -> frozenset[str]:
    """Every function, method and class name defined anywhere in our code."""
    return frozenset(node.name for source in module_files().values() for node in ast.walk(ast.parse(source.read_text()))
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))


def call_problems(text: str, doc: Path) -> list[str]:
    if doc.name.startswith("vllm"):
        return []
    _, spans = code_parts(text)
    called = {match.group(1) for span in spans if (match := re.fullmatch(r"([A-Za-z_]\w*)\(.*\)", span.strip()))}
    return [f"{name}(...): no function, method or class of that name in our code" for name in sorted(called)
            if name not in defined_names() and not hasattr(math, name) and not hasattr(torch, name)]


def path_exists(path: Path) -> bool:
    pattern = re.sub(r"<[^>]*>", "*", str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path))
    if "*" in pattern:
        return any(ROOT.glob(pattern.rstrip("/")))
    return path.exists()


def path_problems(text: str, doc: Path) -> list[str]:
    problems = []
    for word in sorted(set(path_pattern().findall(text))):
        word = re.sub(r":\d+(-\d+)?$", "", word.rstrip(".,:;"))
        if not is_example(word) and not path_exists(ROOT / word):
            problems.append(f"{word}: no such file or folder in the repository")
    for target in sorted(set(LINK.findall(text))):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (doc.parent / target.partition("#")[0]).resolve().exists():
            problems.append(f"link {target}: no such file relative to {doc.relative_to(ROOT)}")
    return problems


def env_problems(text: str) -> list[str]:
    defined = {var.name for var in envs.ALL}
    return [f"{name}: not a variable dflash_rocm.envs defines" for name in sorted(set(ENV.findall(text)))
            if name not in defined]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def command_problems(text: str) -> list[str]:
    blocks, spans = code_parts(text)
    code = "\n".join([body for _, body in blocks] + [f"`{span}`" for span in spans])
    commands = subcommands()
    problems = []
    for line in COMMAND.findall(code):
        words = line.split()
        if not words or words[0].startswith("-"):
            continue
        parser = commands.get(words[0])
        if parser is None:
            problems.append(f"dflash-rocm {words[0]}: no such command (the CLI has {', '.join(commands)})")
            continue
        known = parser._option_string_actions
        problems += [f"dflash-rocm {words[0]} {word}: no such option" for word in words[1:]
                     if word.startswith("--") and word.split("=")[0] not in known]
    return problems


def image_problems(text: str) -> list[str]:
    defaults = {base_image(dockerfile) for dockerfile in DOCKERFILES}
    problems = []
    for build_arg, image in IMAGE.findall(text):
        if build_arg and not SUPPORTED[0] <= image_version(image)[:2] <= SUPPORTED[1]:
            problems.append(f"{image}: its vLLM is outside the supported {SUPPORTED}")
        elif not build_arg and image not in defaults:
            problems.append(f"{image}: no Dockerfile builds on it (they default to {', '.join(sorted(defaults))})")
    return problems


def doc_text(doc: Path) -> str:
    """A doc's text; of a Dockerfile, its comments."""
    text = doc.read_text()
    if doc.name.startswith("Dockerfile"):
        return "\n".join(line.lstrip()[1:] for line in text.splitlines() if line.lstrip().startswith("#"))
    return text


def doc_problems(text: str, doc: Path) -> list[str]:
    """Everything ``text`` (the text of ``doc``) names that the code does not have."""
    return (dotted_problems(text) + call_problems(text, doc) + path_problems(text, doc) + env_problems(text)
            + command_problems(text) + image_problems(text))


# --- the tests ---------------------------------------------------------------------------

def test_the_docs_are_found():
    assert {ROOT / "README.md", ROOT / "backends" / "README.md", ROOT / "docs" / "SPEC.md"} <= set(DOCS)
    assert {"dflash_rocm", "backends", "docs", "tests", "scripts", "docker"} <= set(top_level_folders())


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_what_a_doc_names_exists(doc):
    assert doc_problems(doc_text(doc), doc) == []


def test_the_checker_reports_renamed_names_paths_variables_and_commands():
    """A doc naming what does not exist (a function, a method, a path, a link, a variable, a
    command, an option, an image) is reported by the same checker, item by item; what is not
    ours is not."""
    doc = ROOT / "docs" / "synthetic.md"
    text = "\n".join([
        "Load with `dflash_rocm.load_context_kv_weight(path)` or `ContextKVWeights.from_checkpoint`;",
        "a backend says why in `supports(call)`, not in `not_supported_reasons(call, platform)` or `ceil(x)`;",
        "tables in `backends/rocm/table.py`, the contract in [the spec](SPEC2.md); set DFLASH_ROCM_NOPE=1.",
        "`dflash-rocm bench --hots` and `dflash-rocm speedtest`; the image is `vllm/vllm-openai-rocm:v0.32.0`,",
        "or `--build-arg BASE_IMAGE=vllm/vllm-openai:v0.31.2`.",
        "```python",
        "from dflash_rocm.workloads import SHAPES, attention_input",
        "```",
        "Not ours: `vllm.config.VllmConfig`, v1/attention/backends/rocm_attn.py, `torch.frombuffer`,",
        "`plan.run`, `call.out`, `envs.AITER`, `registry.PRIORITIES`, `backends/mine/__init__.py`,",
        "`backends/<name>/`, [`docs/SPEC.md`](SPEC.md), DFLASH_ROCM_AITER, `BASE_IMAGE=vllm/vllm-openai:v0.33.0`.",
    ])
    assert doc_problems(text, doc) == [
        "dflash_rocm.load_context_kv_weight: no such module or attribute",
        "dflash_rocm.workloads.attention_input: no such module or attribute",
        "ContextKVWeights.from_checkpoint: none of dflash_rocm.weights.ContextKVWeights.from_checkpoint exists",
        "supports(...): no function, method or class of that name in our code",
        "backends/rocm/table.py: no such file or folder in the repository",
        "link SPEC2.md: no such file relative to docs/synthetic.md",
        "DFLASH_ROCM_NOPE: not a variable dflash_rocm.envs defines",
        "dflash-rocm bench --hots: no such option",
        f"dflash-rocm speedtest: no such command (the CLI has {', '.join(subcommands())})",
        "vllm/vllm-openai-rocm:v0.32.0: no Dockerfile builds on it (they default to "
        + ", ".join(sorted(base_image(dockerfile) for dockerfile in DOCKERFILES)) + ")",
        f"vllm/vllm-openai:v0.31.2: its vLLM is outside the supported {SUPPORTED}",
    ]


def readme_table() -> dict[str, str]:
    """The README's variable table: each variable -> its default cell."""
    section = ROOT.joinpath("README.md").read_text().partition("## Environment variables")[2].partition("\n## ")[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| `")]
    return {name: row[2].strip() for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row[1])}


def test_every_variable_envs_defines_is_in_the_readmes_table():
    assert {var.name for var in envs.ALL} == set(readme_table())


def test_the_readmes_defaults_are_envs_defaults():
    """A variable with a default value shows that value; one without says what applies instead."""
    table = readme_table()
    wrong = {var.name: table[var.name] for var in envs.ALL if var.default and table[var.name] != f"`{var.default}`"}
    assert wrong == {}


def test_the_source_names_only_variables_envs_defines():
    """A ``DFLASH_ROCM_*`` string anywhere in our code (set for a subprocess, named in a
    message) is one ``envs`` reads: a renamed variable leaves no stale spelling behind."""
    defined = {var.name for var in envs.ALL}
    stale = {f"{path.relative_to(ROOT)}: {name}" for path in module_files().values()
             for name in ENV.findall(path.read_text()) if name not in defined}
    assert stale == set()


def test_layout_names_every_backend_folder():
    text = (ROOT / "docs" / "layout.md").read_text()
    folders = sorted(p.parent.name for p in (ROOT / "backends").glob("*/__init__.py"))
    assert [name for name in folders if f"{name}/" not in text] == []


def test_a_variables_help_names_the_backend_that_reads_it():
    """``dflash-rocm info`` prints each variable's help; one that starts with a backend's name
    (``rocm: ...``, ``aiter backend: ...``) must be read in that backend's folder."""
    from dflash_rocm.registry import NAMES

    wrong = []
    for var in envs.ALL:
        first = re.split(r"[\s:]", var.help, maxsplit=1)[0]
        if first not in NAMES:
            continue
        attribute = next(name for name, value in vars(envs).items() if value is var)
        sources = "".join(path.read_text() for path in (ROOT / "backends" / first).rglob("*.py"))
        if f"envs.{attribute}" not in sources:
            wrong.append(f"{var.name}: its help names {first}, whose folder never reads envs.{attribute}")
    assert wrong == []
    assert any(re.split(r"[\s:]", var.help, maxsplit=1)[0] in NAMES for var in envs.ALL)


# --- the changelog and the version --------------------------------------------------------

CHANGELOG = ROOT / "CHANGELOG.md"
CHANGE_KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")  # Keep a Changelog's


def test_the_version_is_the_changelogs_newest_release():
    """pyproject.toml, ``dflash_rocm.__version__`` and the newest release in CHANGELOG.md
    name one version (a release bumps all three)."""
    import tomllib

    from dflash_rocm import __version__

    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", CHANGELOG.read_text(), flags=re.M)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert releases and project["version"] == __version__ == releases[0]


def test_the_changelog_keeps_its_form():
    """Keep a Changelog: an ``Unreleased`` section first, then releases; under each only the
    kinds of change it names, one line per entry; short; no issue numbers (they point
    nowhere outside this project's tracker)."""
    lines = CHANGELOG.read_text().splitlines()
    sections = [line for line in lines if line.startswith("## ")]
    assert len(lines) < 150 and sections[0] == "## [Unreleased]"
    assert [line for line in lines if line.startswith("### ") and line[4:] not in CHANGE_KINDS] == []
    entries = [i for i, line in enumerate(lines) if line.startswith("- ")]
    continued = [lines[i + 1] for i in entries if i + 1 < len(lines) and lines[i + 1].startswith(" ")]
    assert entries and continued == []  # no wrapped entries
    assert re.findall(r"(?i)issue \d+|(?<![\w/])#\d+", CHANGELOG.read_text()) == []


# --- facts the docs state -------------------------------------------------------------------

def paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]


def record_fields() -> list[str]:
    """The planning record's fields, in order (a NamedTuple's or a dataclass's)."""
    import dataclasses

    from dflash_rocm.planning import PlanningRecord

    if dataclasses.is_dataclass(PlanningRecord):
        return [f.name for f in dataclasses.fields(PlanningRecord)]
    return list(PlanningRecord._fields)


def test_the_plan_caches_key_in_backends_md_is_the_planning_records_fields():
    """docs/backends.md lists what keys the plan cache: exactly the record's fields, in order
    (a field added to the record, or dropped, fails here until the sentence says so)."""
    (sentence,) = [p for p in paragraphs((ROOT / "docs" / "backends.md").read_text())
                   if "keyed by the call's planning record" in p]
    listed = re.sub(r"\([^()]*\)", "", sentence.partition("whose fields are")[2])  # the asides
    assert re.findall(r"`(\w+)`", listed.partition(".")[0]) == record_fields()


def test_every_measured_on_sentence_points_to_the_machines_paragraph():
    """A figure measured on some machine says which, through benchmarks.md's "Machines"
    paragraph: every paragraph saying "measured on" or "measured here" links to it."""
    unlinked = [f"{doc.relative_to(ROOT)}: {p[:80]}..." for doc in DOCS if doc.suffix == ".md"
                for p in paragraphs(doc.read_text()) if re.search(r"(?i)\bmeasured (on|here)\b", p)
                and "benchmarks.md#machines" not in p and not (doc.name == "benchmarks.md" and "](#machines)" in p)]
    assert unlinked == []
    assert "## Machines" in (ROOT / "docs" / "benchmarks.md").read_text()
