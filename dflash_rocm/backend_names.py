"""The backends' names: the folders under the top-level ``backends/`` (installed, and
linked in a checkout, as ``dflash_rocm/backends``), read from the file system.

Its own module at the bottom of the package so the settings (:mod:`dflash_rocm.envs`) can
judge ``DFLASH_ROCM_BACKEND`` without importing the registry, which sits above the
planning layer that reads the settings; the registry lists the same folders with
:func:`names_in`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable


def names_in(folders: Iterable[str]) -> tuple[str, ...]:
    """The packages (sub-folders with an ``__init__.py``) of ``folders``, sorted."""
    return tuple(sorted({entry.name for folder in folders for entry in Path(folder).iterdir()
                         if (entry / "__init__.py").is_file()}))


FOLDER = str(Path(__file__).with_name("backends"))
NAMES: tuple[str, ...] = names_in([FOLDER])
