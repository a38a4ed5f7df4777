"""Every environment variable dflash_rocm reads, in one table, with one parser per kind.

Values are read at the moment they are needed (never cached at import), so tests and
long-lived servers see changes; ``dflash-rocm info`` prints this table with the values
in effect and whether each is valid.

Switches share one spelling: ``0/1``, ``false/true``, ``off/on``, ``no/yes``, any case,
surrounding blanks ignored; some also take a mode word (``auto``). A value outside that
set is refused where it is used, with a ``ValueError`` that names the variable and the
accepted values: a typo must not silently mean "off". The variables that decide what runs
(:data:`DECIDING`: which backend, whether the vLLM plugin serves) are refused with that
``ValueError`` wherever they are read (:func:`check_deciding`: the CLI's commands print it
as one line, the vLLM plugin logs it as one error line and steps aside). Where an operation reads a knob
(:meth:`EnvVar.setting`), the refusal is a warning and the default applies: no
environment fault fails a call. ``TRITON_INTERPRET`` is the one
exception: Triton itself decides whether kernels are interpreted, so we read it exactly
as Triton does (see :class:`TritonSwitch`) and only *report* values that look mistaken.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from . import backend_names

TRUE_WORDS = ("1", "true", "on", "yes")
_warned: set[str] = set()
FALSE_WORDS = ("0", "false", "off", "no")


def parse_switch(name: str, raw: str, modes: tuple[str, ...] = ()) -> bool | str:
    """``raw`` as a switch: True, False, or one of ``modes`` (lower case)."""
    word = raw.strip().lower()
    if word in modes:
        return word
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    accepted = ", ".join(modes + TRUE_WORDS + FALSE_WORDS)
    raise ValueError(f"{name}={raw!r}: expected one of {accepted} (any case)")


@dataclass(frozen=True)
class EnvVar:
    """A free-form variable: ``value()`` is the string (stripped; the default when unset)."""

    name: str
    default: str
    help: str

    def get(self) -> str:
        return self.text(os.environ.get(self.name))

    def text(self, raw: str | None) -> str:
        """``raw`` (the variable's value as read; None: unset) stripped, or the default."""
        return self.default if raw is None or raw.strip() == "" else raw.strip()

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name, "").strip())

    def value(self) -> Any:
        """The parsed value; ``ValueError`` naming the variable when it is not valid."""
        return self.parse(self.get())

    def parse(self, raw: str) -> Any:
        return raw

    def setting(self) -> Any:
        """The value where an operation reads it. A bad value is refused, once, with a
        warning that names the variable and what it accepts, and the default applies: a
        tuning or probing knob must never fail an attention or precompute call."""
        try:
            return self.value()
        except ValueError as exc:
            return self._refused(exc)

    def setting_of(self, raw: str | None) -> Any:
        """:meth:`setting` of ``raw``, the variable's value as read before (None: unset):
        what a planning record holds is parsed when a plan is made."""
        try:
            return self.parse(self.text(raw))
        except ValueError as exc:
            return self._refused(exc)

    def _refused(self, exc: ValueError) -> Any:
        if self.name not in _warned:
            _warned.add(self.name)
            logging.getLogger("dflash_rocm").warning("%s; using the default %r", exc, self.default)
        return self.parse(self.default)

    def problem(self) -> str | None:
        """Why the current value is not valid (None: it is), for ``dflash-rocm info``."""
        try:
            self.value()
        except ValueError as exc:
            return str(exc)
        return None


@dataclass(frozen=True)
class Switch(EnvVar):
    """On/off, optionally with mode words (``modes``): ``value()`` is a bool or a mode."""

    modes: tuple[str, ...] = ()

    def parse(self, raw: str) -> bool | str:
        return parse_switch(self.name, raw, self.modes)


@dataclass(frozen=True)
class PositiveInt(EnvVar):
    """``value()`` is a positive int, or None when unset."""

    def parse(self, raw: str) -> int | None:
        if not raw.strip():
            return None
        try:
            number = int(raw)
        except ValueError:
            number = 0
        if number < 1:
            raise ValueError(f"{self.name}={raw!r}: expected a positive integer")
        return number


LOG_LEVEL_NAMES = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


@dataclass(frozen=True)
class LogLevel(EnvVar):
    """``value()`` is a :mod:`logging` level: a level name (any case) or a number >= 0."""

    def parse(self, raw: str) -> int:
        word = raw.upper()
        if word in LOG_LEVEL_NAMES:
            return getattr(logging, word)
        if word.isdigit():
            return int(word)
        raise ValueError(f"{self.name}={raw!r}: expected one of {', '.join(LOG_LEVEL_NAMES)} "
                         "(any case) or a number >= 0")


@dataclass(frozen=True)
class BackendName(EnvVar):
    """``value()`` is ``auto`` or a registered backend's name (any case, blanks stripped)."""

    def parse(self, raw: str) -> str:
        name = raw.strip().lower()
        if name != "auto" and name not in backend_names.NAMES:
            raise ValueError(f"{self.name}={raw!r}: not a backend; valid names: auto, "
                             f"{', '.join(backend_names.NAMES)} (any case)")
        return name


# What Triton 3.9 reads as "on" (its C++ ``getenv_bool``, behind ``triton.knobs``):
# the value lower-cased, *not* stripped, compared with these words; anything else is
# "off" without a word of complaint. Tested against Triton's own function.
TRITON_TRUE_WORDS = TRUE_WORDS + ("y",)


@dataclass(frozen=True)
class TritonSwitch(EnvVar):
    """``TRITON_INTERPRET`` as Triton reads it (so ``true`` means on, and `` 1`` off):
    our view of whether kernels are interpreted must be Triton's. ``problem()`` flags
    values Triton takes as off that are not one of our off words."""

    def value(self) -> bool:
        raw = os.environ.get(self.name)
        return raw is not None and raw.lower() in TRITON_TRUE_WORDS

    def problem(self) -> str | None:
        raw = os.environ.get(self.name)
        if raw is None or self.value() or raw.strip().lower() in FALSE_WORDS + ("",):
            return None
        return (f"{self.name}={raw!r}: Triton reads it as off (it takes {', '.join(TRITON_TRUE_WORDS)} "
                "as on, any case, blanks not stripped)")


BACKEND = BackendName(
    "DFLASH_ROCM_BACKEND", "auto",
    "backend for both operations: auto, reference, triton, rocm, aiter, cuda or cpu "
    "(the backend= argument of a call wins)")
LOG_LEVEL = LogLevel(
    "DFLASH_ROCM_LOG_LEVEL", "WARNING",
    "level of the 'dflash_rocm' logger: DEBUG, INFO, WARNING, ERROR, CRITICAL or a number "
    "(INFO shows which backend served each new call shape); a bad value warns and keeps WARNING")
QUERY_LIMIT = PositiveInt(
    "DFLASH_ROCM_QUERY_LIMIT", "",
    "rocm: largest query length per request the segmented kernel is compiled and tuned for "
    "(DFlash: num_speculative_tokens + 1); longer queries take the unsegmented path")
TUNE = Switch(
    "DFLASH_ROCM_TUNE", "auto",
    "rocm startup tuning: auto (on for RDNA gfx1x), or on/off (1/0, true/false, yes/no)",
    modes=("auto",))
CACHE_DIR = EnvVar(
    "DFLASH_ROCM_CACHE_DIR", "",
    "where tuned launch configs are kept (default: $XDG_CACHE_HOME/dflash_rocm)")
AITER = Switch(
    "DFLASH_ROCM_AITER", "auto",
    "aiter backend: off (0/false/no) never uses aiter; auto or on lets it serve attention on CDNA where "
    "aiter's paged attention serves the call (checked against the rocm backend's Triton kernel on first use)",
    modes=("auto",))
TAIL_MERGE = Switch(
    "DFLASH_ROCM_TAIL_MERGE", "1",
    "off (0/false/no) merges a split attention tile by a second launch where the tables chose merger "
    "programs that wait on its segments in the same launch (a planning switch: a change applies from the next call)")
VLLM = Switch(
    "DFLASH_ROCM_VLLM", "1",
    "off (0/false/no) leaves vLLM untouched even when the plugin is installed")
TRITON_INTERPRET = TritonSwitch(
    "TRITON_INTERPRET", "0",
    "on (1/true/yes/on, as Triton reads it) runs Triton kernels on CPU tensors through the "
    "interpreter (read when kernels are first imported)")
NO_COLOR = EnvVar(
    "NO_COLOR", "",
    "any value: the command line prints no colour (no-color.org)")
FORCE_COLOR = EnvVar(
    "FORCE_COLOR", "",
    "any value but 0: the command line colours results even when stdout is not a terminal")

DECIDING: tuple[EnvVar, ...] = (BACKEND, VLLM)  # a bad value is a ValueError, never a default


def check_deciding() -> None:
    """Refuse (``ValueError`` naming the variable and what it accepts) a bad value of a
    variable that decides what runs."""
    for var in DECIDING:
        var.value()


ALL: tuple[EnvVar, ...] = (BACKEND, LOG_LEVEL, QUERY_LIMIT, TUNE, CACHE_DIR, AITER, TAIL_MERGE, VLLM,
                           TRITON_INTERPRET, NO_COLOR, FORCE_COLOR)
