"""Reading the repository's Dockerfiles: their instructions, COPY sources and base image."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile*"))


def instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile: comments dropped, continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        word, _, rest = (pending + line).strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def copy_sources(arguments: str) -> list[str] | None:
    """The sources of a ``COPY``/``ADD`` (None for ``--from``: another stage's files)."""
    words = json.loads(arguments) if arguments.startswith("[") else shlex.split(arguments)
    flags = [w for w in words if w.startswith("--")]
    if any(flag.startswith("--from") for flag in flags):
        return None
    return [w for w in words if not w.startswith("--")][:-1]


def base_image(dockerfile: Path) -> str:
    """The default of ``ARG BASE_IMAGE=...`` (the image ``FROM ${BASE_IMAGE}`` builds on)."""
    for word, arguments in instructions(dockerfile.read_text()):
        if word == "ARG" and arguments.startswith("BASE_IMAGE="):
            return arguments.partition("=")[2]
    raise AssertionError(f"{dockerfile.name}: no ARG BASE_IMAGE=... default")


def image_version(image: str) -> tuple[int, int, int]:
    """The vLLM version of an image tagged ``vX.Y.Z``."""
    match = re.search(r":v(\d+)\.(\d+)\.(\d+)$", image)
    assert match, f"{image}: no vX.Y.Z tag"
    return tuple(int(g) for g in match.groups())


def replay_copies(dockerfile: Path, context: Path, image_root: Path) -> Path:
    """Lay out ``image_root`` as the Dockerfile's ``WORKDIR`` and ``COPY`` instructions lay out
    the image (links kept, as COPY keeps them); returns the final working folder inside it."""
    import shutil

    workdir = image_root
    for word, arguments in instructions(dockerfile.read_text()):
        if word == "WORKDIR":
            workdir = image_root / arguments.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif word == "COPY":
            sources = copy_sources(arguments)
            if sources is None:
                continue
            words = json.loads(arguments) if arguments.startswith("[") else shlex.split(arguments)
            dest = workdir / words[-1]
            for source in sources:
                origin = context / source
                target = dest / origin.name if words[-1].endswith("/") else dest
                if origin.is_dir():
                    shutil.copytree(origin, target, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(origin, target)
    return workdir
