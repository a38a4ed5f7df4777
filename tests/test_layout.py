"""The design card's layout holds, installs and ships.

The card puts ``pyproject.toml``, ``dflash_rocm/``, ``backends/``, ``tests/``, ``docker/`` and
``README.md`` at the top. ``backends/`` installs as ``dflash_rocm.backends`` through setuptools'
``package-dir`` and an explicit package list, so three things can drift silently: a package
folder the list misses (it is left out of every wheel, and the editable install still finds
it), a build that imports only from the checkout, and a Dockerfile that copies what is no
longer there. Each has a test here; the checkers take a root so they are shown to fail on a
synthetic tree.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_rocm.vllm_plugin.compat import SUPPORTED
from support import bare_interpreter
from dockerfiles import DOCKERFILES, base_image, copy_sources, image_version, instructions, replay_copies

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
CARD_ENTRIES = ("pyproject.toml", "dflash_rocm", "backends", "tests", "docker", "README.md")


# --- the package list -------------------------------------------------------------------

def setuptools_table(root: Path) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_roots(root: Path) -> dict[str, Path]:
    """Dotted name -> source folder of every root the build maps: ``package-dir``'s entries,
    and each listed top-level package that sits in its own folder."""
    table = setuptools_table(root)
    roots = {name: root / folder for name, folder in table.get("package-dir", {}).items()}
    for name in table["packages"]:
        if "." not in name:
            roots.setdefault(name, root / name)
    return roots


def package_folders(root: Path) -> dict[str, Path]:
    """Every package on disk (a folder with an ``__init__.py`` under a mapped root), by the
    dotted name it installs as; a nested root (``dflash_rocm.backends``) wins over the folder
    of the same name inside its parent."""
    roots = package_roots(root)
    found: dict[str, Path] = {}
    for name, folder in sorted(roots.items(), key=lambda item: item[0].count(".")):
        for init in sorted(folder.rglob("__init__.py")):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(folder).parts
            found[".".join((name, *rel))] = init.parent
    return found


def package_list_problems(root: Path) -> list[str]:
    """Why the explicit package list and the folders disagree (empty: they agree)."""
    listed = set(setuptools_table(root)["packages"])
    on_disk = package_folders(root)
    problems = [f"{name} ({path.relative_to(root)}) has an __init__.py but is not in pyproject's package list"
                for name, path in sorted(on_disk.items()) if name not in listed]
    problems += [f"{name} is in pyproject's package list but has no folder with an __init__.py"
                 for name in sorted(listed - set(on_disk))]
    for folder in package_roots(root).values():
        for source in sorted(folder.rglob("*.py")):
            if "__pycache__" not in source.parts and not (source.parent / "__init__.py").exists():
                problems.append(f"{source.relative_to(root)} is in a folder without an __init__.py: never installed")
    return problems


def test_the_package_list_is_the_folders():
    assert package_list_problems(ROOT) == []


def synthetic_tree(tmp_path: Path) -> Path:
    """The checkout's pyproject and an empty tree of its package folders."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for path in package_folders(ROOT).values():
        target = tmp_path / path.relative_to(ROOT)
        target.mkdir(parents=True, exist_ok=True)
        (target / "__init__.py").touch()
    return tmp_path


def test_the_package_list_check_fails_on_a_folder_it_misses(tmp_path):
    root = synthetic_tree(tmp_path)
    assert package_list_problems(root) == []
    (root / "backends" / "mine").mkdir()
    (root / "backends" / "mine" / "__init__.py").touch()
    (root / "dflash_rocm" / "ops" / "newop").mkdir()
    (root / "dflash_rocm" / "ops" / "newop" / "__init__.py").touch()
    problems = package_list_problems(root)
    assert len(problems) == 2
    assert problems[0].startswith("dflash_rocm.backends.mine (backends/mine)")
    assert problems[1].startswith("dflash_rocm.ops.newop (dflash_rocm/ops/newop)")


def test_the_package_list_check_fails_on_a_listed_package_without_a_folder(tmp_path):
    root = synthetic_tree(tmp_path)
    (root / "backends" / "cpu" / "__init__.py").unlink()
    (root / "backends" / "cpu" / "keys.py").touch()
    assert package_list_problems(root) == [
        "dflash_rocm.backends.cpu is in pyproject's package list but has no folder with an __init__.py",
        "backends/cpu/keys.py is in a folder without an __init__.py: never installed",
    ]


# --- the checkout is a complete package -------------------------------------------------

def test_the_package_links_the_backends_folder():
    """``dflash_rocm/backends`` is a committed link to the card's ``backends/`` (as Triton links
    ``third_party/<vendor>/backend`` into its package tree): a checkout is the whole package
    for ``python -m`` from the root, IDEs and import-graph tools, and the wheel still takes each
    file once, from ``backends/`` through ``package-dir``."""
    link = ROOT / "dflash_rocm" / "backends"
    assert link.is_symlink() and os.readlink(link) == "../backends"
    if (ROOT / ".git").exists() and shutil.which("git"):
        mode = subprocess.run(["git", "ls-files", "-s", "dflash_rocm/backends"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.split()
        assert mode and mode[0] == "120000", "dflash_rocm/backends must be committed as a link"


def test_the_checkout_imports_every_module_without_an_install():
    """From the root, in an interpreter where the package is not installed (no editable hook):
    every module, the backends included, comes from the checkout (``backends/`` through the link)."""
    prefix, env = bare_interpreter(ROOT)
    result = subprocess.run([*prefix, "-c", IMPORT_ALL, *modules(ROOT)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    files = {name: Path(path).resolve() for name, path in json.loads(result.stdout).items()}
    strays = {name: str(path) for name, path in files.items() if not path.is_relative_to(ROOT.resolve())}
    assert strays == {}
    backends = {name: path for name, path in files.items() if name.startswith("dflash_rocm.backends.")}
    assert backends and all(path.is_relative_to((ROOT / "backends").resolve()) for path in backends.values())


# --- the card's top-level entries -------------------------------------------------------

def test_the_cards_top_level_entries_exist():
    missing = [name for name in CARD_ENTRIES if not (ROOT / name).exists()]
    assert missing == []
    if (ROOT / ".git").exists() and shutil.which("git"):  # a fresh clone has only what git tracks
        tracked = subprocess.run(["git", "ls-files", "--", *CARD_ENTRIES], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.split()
        assert {path.split("/")[0] for path in tracked} == set(CARD_ENTRIES)


# --- a wheel and a plain install import every module from where they were installed ----

def modules(root: Path) -> list[str]:
    """Every module the build ships, by dotted name (packages and their .py files; not
    ``__main__``, which runs the command line when imported: ``check`` below runs it)."""
    names = []
    for name, folder in package_folders(root).items():
        names.append(name)
        names += [f"{name}.{source.stem}" for source in sorted(folder.glob("*.py"))
                  if source.stem not in ("__init__", "__main__")]
    return sorted(names)


def build_sources(tmp: Path) -> Path:
    """What the build reads, copied out of the checkout (so nothing is built in it)."""
    source = tmp / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in {path.relative_to(ROOT).parts[0] for path in package_roots(ROOT).values()}:
        shutil.copytree(ROOT / folder, source / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    return source


def pip(*args: str) -> None:
    """pip of this interpreter; builds are isolated (pip fetches setuptools: CI has the network)."""
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True,
                   timeout=600)


def run_installed(site: Path, *args: str) -> subprocess.CompletedProcess:
    """``python args`` with ``site`` first on the path and the checkout nowhere on it: the
    working directory is ``site``'s parent, and this interpreter's own packages (torch) stay."""
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run([sys.executable, *args], cwd=site.parent, env=env, capture_output=True, text=True,
                          timeout=600)


IMPORT_ALL = """
import importlib, json, sys
print(json.dumps({name: importlib.import_module(name).__file__ for name in sys.argv[1:]}))
"""


def assert_imports_everything_from(site: Path) -> None:
    expected = modules(ROOT)
    result = run_installed(site, "-c", IMPORT_ALL, *expected)
    assert result.returncode == 0, result.stderr
    files = json.loads(result.stdout)
    strays = {name: path for name, path in files.items() if not Path(path).resolve().is_relative_to(site.resolve())}
    assert strays == {}, "imported from outside the install"
    assert any(name.startswith("dflash_rocm.backends.") for name in files)


@pytest.mark.slow
def test_a_wheel_imports_every_backend_and_passes_check(tmp_path):
    source = build_sources(tmp_path)
    pip("wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(source))
    (wheel,) = (tmp_path / "dist").glob("dflash_rocm-*.whl")
    site = tmp_path / "site"
    pip("install", "--no-deps", "--target", str(site), str(wheel))
    assert_imports_everything_from(site)
    result = run_installed(site, "-m", "dflash_rocm", "check")  # ~13 s on 2 CPU cores: the whole check
    assert result.returncode == 0, result.stdout + result.stderr
    assert "agree with the reference" in result.stdout


@pytest.mark.slow
def test_pip_install_dot_imports_every_backend(tmp_path):
    source = build_sources(tmp_path)
    site = tmp_path / "site"
    pip("install", "--no-deps", "--target", str(site), str(source))
    assert_imports_everything_from(site)


# --- the Dockerfiles build from what is in the repository --------------------------------

def dockerignore_excludes(root: Path, path: str) -> bool:
    """Whether ``.dockerignore`` keeps ``path`` (or a folder above it) out of the context:
    the last matching pattern decides, ``!`` re-includes, ``**/`` spans any folders."""
    ignore = root / ".dockerignore"
    patterns = [p.strip() for p in ignore.read_text().splitlines()] if ignore.exists() else []
    parts = Path(path).parts
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        regex = dockerignore_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(candidate) for candidate in candidates):
            excluded = not negate
    return excluded


def dockerignore_regex(pattern: str) -> re.Pattern:
    out = ""
    for piece in re.split(r"(\*\*/|\*\*|\*|\?)", pattern):
        out += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(piece, re.escape(piece))
    return re.compile(out)


def copy_problems(root: Path, dockerfile: Path) -> list[str]:
    """COPY/ADD sources that are missing or kept out of the build context (the context is the
    repository root: ``docker build -f docker/<file> .``), and what ``pip install .`` needs
    that no COPY brings."""
    problems = []
    copied: list[str] = []
    for word, arguments in instructions(dockerfile.read_text()):
        if word not in ("COPY", "ADD"):
            continue
        for source in copy_sources(arguments) or ():
            if "://" in source:
                continue  # ADD of a URL is outside the repository by design
            matches = sorted(root.glob(source)) if any(c in source for c in "*?[") else [root / source]
            if not any(match.exists() for match in matches):
                problems.append(f"{dockerfile.name}: {word} {source}: not in the repository")
            elif dockerignore_excludes(root, source.rstrip("/")):
                problems.append(f"{dockerfile.name}: {word} {source}: excluded by .dockerignore")
            copied.append(source.strip("/").removeprefix("./"))
    table = tomllib.loads((root / "pyproject.toml").read_text())
    needed = {"pyproject.toml", table["project"]["readme"]}
    needed |= {path.relative_to(root).parts[0] for path in package_roots(root).values()}
    problems += [f"{dockerfile.name}: no COPY brings {name}, which pip install . reads"
                 for name in sorted(needed) if not any(fnmatch.fnmatch(name, c) for c in copied)]
    return problems


def test_there_are_dockerfiles():
    assert {path.name for path in DOCKERFILES} >= {"Dockerfile.rocm", "Dockerfile.cuda"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_every_dockerfile_copies_what_the_repository_has(dockerfile):
    assert copy_problems(ROOT, dockerfile) == []


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_every_base_image_runs_a_supported_vllm(dockerfile):
    major, minor, _ = image_version(base_image(dockerfile))
    low, high = SUPPORTED
    assert low <= (major, minor) <= high


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_every_dockerfile_fails_its_build_when_a_backend_cannot_import(dockerfile):
    runs = [arguments for word, arguments in instructions(dockerfile.read_text()) if word == "RUN"]
    assert any("-m dflash_rocm info --check-imports" in run for run in runs)


@pytest.mark.slow
def test_the_images_steps_import_every_backend_and_collect_the_rocm_tests(tmp_path):
    """The ROCm image as built, without Docker: its COPY layout, a non-editable install, then
    its ``info`` step and its entrypoint's collection run from the copied folder (the image's
    working directory, first on the path for ``python -m``) in an interpreter where the
    package is not installed but for that install."""
    workdir = replay_copies(ROOT / "docker" / "Dockerfile.rocm", ROOT, tmp_path / "image")
    site = tmp_path / "site"
    pip("install", "--no-deps", "--no-build-isolation", "--target", str(site), str(workdir))
    prefix, env = bare_interpreter(workdir)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    info = subprocess.run([*prefix, "-m", "dflash_rocm", "info", "--check-imports", "--json"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert info.returncode == 0, info.stderr[-3000:]
    reasons = [r for b in json.loads(info.stdout)["backends"].values() for r in b["reasons"]]
    assert not [r for r in reasons if "cannot import" in r]
    collect = subprocess.run([*prefix, "-m", "pytest", "-m", "rocm", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "tests"], cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-3000:]
    counts = re.search(r"(\d+)/\d+ tests collected", collect.stdout)
    assert counts and int(counts.group(1)) > 0, collect.stdout[-500:]


def test_the_copy_check_fails_on_a_missing_or_ignored_source(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for name in ("dflash_rocm", "backends/__pycache__", "tests"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "README.md").touch()
    (tmp_path / ".dockerignore").write_text("**/__pycache__\ntests\n!tests/keep\n")
    dockerfile = tmp_path / "Dockerfile.x"
    dockerfile.write_text("ARG BASE_IMAGE=x:v0.34.0\nFROM ${BASE_IMAGE}\n"
                          "COPY pyproject.toml README.md ./\n# COPY comment ./x\nCOPY dflash_rocm \\\n  ./dflash_rocm\n"
                          "COPY backends/__pycache__ ./b\nCOPY tests ./tests\nCOPY --from=build /x /y\n"
                          "COPY [\"scripts\", \"./scripts\"]\n")
    assert copy_problems(tmp_path, dockerfile) == [
        "Dockerfile.x: COPY backends/__pycache__: excluded by .dockerignore",
        "Dockerfile.x: COPY tests: excluded by .dockerignore",
        "Dockerfile.x: COPY scripts: not in the repository",
        "Dockerfile.x: no COPY brings backends, which pip install . reads",
    ]
    assert not dockerignore_excludes(tmp_path, "tests/keep")
    assert image_version(base_image(dockerfile)) == (0, 34, 0)
