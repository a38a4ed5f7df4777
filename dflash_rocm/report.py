"""Plain-text output for the command line (info, check, bench, tune), shared by every command.

A person reads these on an 80-120 column terminal, so by default everything is laid out
within ``WIDTH`` columns: tables shrink their free-text columns by wrapping them, long
notes become numbered footnotes, free text wraps with a hanging indent, and a backend
that cannot run here is named once under the table instead of on every row. ``width=None``
(``--wide``) keeps one line per row with every note in full, for grep and wide screens.

Colour marks results (green PASS, red FAIL/ERROR, dim SKIP) only when the output is a
terminal and ``NO_COLOR`` is unset; every width is measured without the escape codes.
This module imports nothing of the package but ``envs``, so any module may use it.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence, TextIO

from . import envs

WIDTH = 100
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TRAILING_PARENTHESIS = re.compile(r"\s*\([^()]*\)$")

def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def visible_len(text: str) -> int:
    """Columns ``text`` takes on a terminal (colour codes take none)."""
    return len(strip_ansi(text))


@dataclass(frozen=True)
class Style:
    """Colours for a stream; disabled, every method returns its text unchanged."""

    enabled: bool = False

    _CODES = {"green": "32", "red": "1;31", "dim": "2", "bold": "1"}
    _STATUS = {"PASS": "green", "FAIL": "red", "ERROR": "red", "SKIP": "dim"}

    @classmethod
    def for_stream(cls, stream: TextIO) -> "Style":
        """Colour when ``stream`` is a terminal, unless ``NO_COLOR`` is set; ``FORCE_COLOR``
        (not ``0``) turns it on for pipes too (CI logs that render ANSI)."""
        if envs.NO_COLOR.is_set():
            return cls(False)
        if envs.FORCE_COLOR.is_set() and envs.FORCE_COLOR.get() != "0":
            return cls(True)
        isatty = getattr(stream, "isatty", None)
        return cls(bool(isatty and isatty()))

    def paint(self, text: str, colour: str) -> str:
        if not self.enabled or not text:
            return text
        return f"\x1b[{self._CODES[colour]}m{text}\x1b[0m"

    def status(self, status: str) -> str:
        """A result word (PASS, FAIL, ERROR, SKIP, ...) in the colour that makes it stand out."""
        colour = self._STATUS.get(status)
        return self.paint(status, colour) if colour else status


def wrap(text: str, width: int | None, indent: str = "  ") -> str:
    """``text`` broken into lines of at most ``width`` columns, continuation lines indented;
    unchanged when ``width`` is None."""
    if width is None or visible_len(text) <= width:
        return text
    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False,
                                   break_long_words=False))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, width: int | None = None,
                 wrap_columns: Iterable[str] = (), omit_empty: Iterable[str] = (),
                 group_by: Sequence[str] = ()) -> str:
    """Aligned columns under a header and a rule.

    width: when the table is wider, the ``wrap_columns`` (plain text) shrink, widest first,
      down to 12 columns each, their cells wrapping onto continuation lines.
    omit_empty: columns left out when every cell is blank.
    group_by: leading columns turned into a heading line over each run of rows sharing
      their values (rows must come grouped); the other columns stay aligned across groups.
    """
    headers = [str(h) for h in headers]
    body = [["" if c is None else str(c) for c in row] for row in rows]
    optional, wrappable = set(omit_empty), set(wrap_columns)
    keep = [i for i, h in enumerate(headers)
            if h not in optional or any(strip_ansi(r[i]).strip() for r in body)]
    grouped = [headers.index(h) for h in group_by]
    keep = [i for i in keep if i not in grouped]
    headers = [headers[i] for i in keep]
    groups = [(tuple(r[i] for i in grouped), [r[i] for i in keep]) for r in body]

    widths = [max([visible_len(headers[c])] + [visible_len(r[c]) for _, r in groups]) for c in range(len(keep))]
    _shrink(widths, [c for c, h in enumerate(headers) if h in wrappable], width)

    lines = [_join([[h] for h in headers], widths)[0], "  ".join("-" * w for w in widths)]
    heading = None
    for key, row in groups:
        if grouped and key != heading:
            heading = key
            lines.append(", ".join(key) + ":")
        lines += _join([_cell_lines(cell, w) for cell, w in zip(row, widths)], widths)
    return "\n".join(lines)


def _shrink(widths: list[int], wrappable: list[int], width: int | None, floor: int = 12) -> None:
    """Narrow the widest wrappable column by one character at a time until a row fits."""
    if width is None:
        return
    while sum(widths) + 2 * (len(widths) - 1) > width:
        candidates = [c for c in wrappable if widths[c] > floor]
        if not candidates:
            return
        widths[max(candidates, key=lambda c: widths[c])] -= 1


def _cell_lines(cell: str, width: int) -> list[str]:
    """A cell as the lines it takes in a column ``width`` wide (only plain-text cells of
    wrap columns are ever wider than their column)."""
    if visible_len(cell) <= width:
        return [cell]
    return textwrap.wrap(cell, width, break_on_hyphens=False)


def _join(cells: list[list[str]], widths: list[int]) -> list[str]:
    """One row whose cells may span several lines, padded by visible width."""
    height = max(len(c) for c in cells)
    out = []
    for k in range(height):
        parts = [(c[k] if k < len(c) else "") for c in cells]
        out.append("  ".join(p + " " * (w - visible_len(p)) for p, w in zip(parts, widths)).rstrip())
    return out


def short_reason(note: str, limit: int = 60) -> str:
    """The first of ``"; "``-joined reasons without its trailing parenthesis (the details
    --wide and --json keep), cut to ``limit`` characters."""
    first = note.split("; ")[0]
    first = _TRAILING_PARENTHESIS.sub("", first) or first
    return first if len(first) <= limit else first[:limit - 1].rstrip() + "…"


def never_ran(entries: Iterable[tuple[str, str | None]]) -> dict[str, list[str]]:
    """From (backend, why it did not run or None when it ran) pairs, the backends that ran
    nowhere, each with its distinct reasons in order of appearance."""
    ran: set[str] = set()
    reasons: dict[str, list[str]] = {}
    for backend, why in entries:
        if why is None:
            ran.add(backend)
        elif why not in reasons.setdefault(backend, []):
            reasons[backend].append(why)
    return {b: r for b, r in reasons.items() if b not in ran}


def not_run_here(reasons: Mapping[str, Sequence[str]], width: int | None) -> str:
    """One line (wrapped) naming each backend that could not run, with its first reason."""
    if not reasons:
        return ""
    parts = "; ".join(f"{name} — {short_reason(notes[0])}" for name, notes in reasons.items())
    return wrap(f"not run here: {parts} (in full: --wide)", width)


@dataclass
class Footnotes:
    """Notes longer than ``limit`` replaced by ``[n]`` in the table and printed in full
    below it; the same note always gets the same number."""

    limit: int = 24
    notes: list[str] = field(default_factory=list)

    def cite(self, note: str) -> str:
        if len(note) <= self.limit:
            return note
        if note not in self.notes:
            self.notes.append(note)
        return f"[{self.notes.index(note) + 1}]"

    def render(self, width: int | None) -> str:
        return "\n".join(wrap(f"[{i}] {n}", width, indent="    ") for i, n in enumerate(self.notes, 1))


def join_blocks(*blocks: str) -> str:
    """Non-empty blocks of text separated by one blank line."""
    return "\n\n".join(b for b in blocks if b)
