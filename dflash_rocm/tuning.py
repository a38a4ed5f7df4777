"""Startup tuning of launch configurations: search, validate, promote, persist.

For each workload (batch, query length, key span) the tuner times a few candidates
around the table's choice. A candidate is considered only after its output matches the
table config's output on the same inputs, and replaces it only on a clear win: the
incumbent's median time over the candidate's, across repeated rounds, must reach
``min_speedup``. Winners are kept as JSON under ``DFLASH_ROCM_CACHE_DIR`` (default
``$XDG_CACHE_HOME/dflash_rocm``), one file per identity (architecture, versions, kernel
source, dtypes, heads, page size, causal, window, sinks, query limit).

The tuner is an optimisation, so no fault of its cache may fail a call: a file that is
unreadable, not JSON, too deeply nested, of another schema or identity is ignored and
rewritten; an entry that does not pass the caller's validation is dropped and the file
rewritten; a directory that cannot be created, locked or written leaves the missing
workloads on the table's configs (one warning naming the path). Writes happen only under
an exclusive file lock (tensor-parallel ranks: the first tunes, the others wait and read
its file), after re-reading the file, and are atomic (temporary file, fsync, rename), so
concurrent writers neither lose an update nor leave a torn file; a reader needs no lock.

Everything device-specific (running a config, timing it, validating an entry) is
injected, so the logic is tested on CPU with a fake timer.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Generic, Iterable, Sequence, TypeVar

import torch

from . import envs
from .contract import relative_error

logger = logging.getLogger("dflash_rocm")

SCHEMA = 1
MIN_SPEEDUP = 1.03  # a clear win: 3% faster by paired medians
VALIDATION_TOLERANCE = 5e-3  # relative error against the table config's output
ROUNDS = 3
MAX_FILE_BYTES = 16 << 20  # a table is a few KB; anything this big is not ours


_generation = 0


def generation() -> int:
    """How many times a backend's tuned tables in this process changed (loaded, tuned,
    an entry dropped, forgotten): part of every planning record, so a plan made under
    other tables is never handed out (:mod:`dflash_rocm.planning`)."""
    return _generation


def tables_changed() -> None:
    """Say that tuned tables changed (a backend's tuner calls it)."""
    global _generation
    _generation += 1


def cache_dir() -> Path:
    if envs.CACHE_DIR.is_set():
        return Path(envs.CACHE_DIR.get()).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash_rocm"


def identity_digest(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def table_path(identity: dict[str, Any], kind: str = "attention") -> Path:
    return cache_dir() / f"{kind}-{identity_digest(identity)}.json"


@dataclass(frozen=True)
class Workload:
    batch: int
    query_len: int
    key_span: int


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}: expected a positive int, got {value!r}")
    return value


def _optional_time(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what}: expected a time >= 0 or null, got {value!r}")
    return float(value)


@dataclass
class TunedEntry:
    workload: Workload
    default: dict
    best: dict
    default_us: float | None
    best_us: float | None
    speedup: float
    rejected: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["workload"] = asdict(self.workload)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "TunedEntry":
        """An entry as written by :meth:`as_dict`; ``ValueError`` for anything else
        (unknown or missing keys, wrong types, out-of-range numbers)."""
        if not isinstance(d, dict):
            raise ValueError(f"entry: expected an object, got {type(d).__name__}")
        keys = set(cls.__dataclass_fields__)
        if set(d) - keys or {"workload", "default", "best", "speedup"} - set(d):
            raise ValueError(f"entry keys {sorted(d)}: expected {sorted(keys)}")
        w = d["workload"]
        if not isinstance(w, dict) or set(w) != set(Workload.__dataclass_fields__):
            raise ValueError(f"workload {w!r}: expected batch, query_len and key_span")
        workload = Workload(**{k: _positive_int(v, f"workload.{k}") for k, v in w.items()})
        for name in ("default", "best"):
            if not isinstance(d[name], dict):
                raise ValueError(f"{name}: expected an object, got {d[name]!r}")
        speedup = d["speedup"]
        if isinstance(speedup, bool) or not isinstance(speedup, (int, float)) or not (
                math.isfinite(speedup) and speedup > 0):
            raise ValueError(f"speedup: expected a positive number, got {speedup!r}")
        rejected = d.get("rejected", [])
        if not isinstance(rejected, list) or not all(isinstance(r, str) for r in rejected):
            raise ValueError("rejected: expected a list of strings")
        return cls(workload=workload, default=dict(d["default"]), best=dict(d["best"]),
                   default_us=_optional_time(d.get("default_us"), "default_us"),
                   best_us=_optional_time(d.get("best_us"), "best_us"), speedup=float(speedup),
                   rejected=list(rejected))


T = TypeVar("T")


class WorkloadIndex(Generic[T]):
    """The value of the smallest tuned workload that covers a call (ceiling bucket on
    batch, query length and key span; smallest by query length, then batch, then span),
    found by bisection over sorted buckets instead of a scan: it is asked on every call."""

    def __init__(self, items: Iterable[tuple[Workload, T]]) -> None:
        nested: dict[int, dict[int, dict[int, T]]] = {}
        for w, value in items:
            nested.setdefault(w.query_len, {}).setdefault(w.batch, {}).setdefault(w.key_span, value)
        self._query_lens = sorted(nested)
        self._levels = [
            (sorted(by_batch), [(sorted(by_span), [by_span[s] for s in sorted(by_span)])
                                for _, by_span in sorted(by_batch.items())])
            for _, by_batch in sorted(nested.items())]

    def find(self, batch: int, query_len: int, key_span: int) -> T | None:
        for batches, rows in self._levels[bisect.bisect_left(self._query_lens, query_len):]:
            for spans, values in rows[bisect.bisect_left(batches, batch):]:
                i = bisect.bisect_left(spans, key_span)
                if i < len(spans):
                    return values[i]
        return None


@dataclass
class TunedTable:
    identity: dict[str, Any]
    entries: list[TunedEntry]

    @functools.cached_property
    def _index(self) -> WorkloadIndex[dict]:
        return WorkloadIndex((e.workload, e.best) for e in self.entries)

    def lookup(self, batch: int, query_len: int, key_span: int) -> dict | None:
        """The tuned config of the smallest tuned workload that covers this call; None
        when the call is larger than anything tuned (the table's own config then
        applies). The index is built on first use: do not change ``entries`` after."""
        return self._index.find(batch, query_len, key_span)


EntryCheck = Callable[[TunedEntry], None]


@dataclass
class ReadResult:
    """What a read found: the valid entries (None: no usable file) and what was wrong."""

    table: TunedTable | None
    problems: list[str]

    @property
    def dirty(self) -> bool:
        return bool(self.problems)


def read_table(path: Path, identity: dict[str, Any], check: EntryCheck | None = None) -> ReadResult:
    """The table at ``path``, never raising: a missing file is no table and no problem;
    a file that cannot be read or parsed, or belongs to another schema or identity, is
    no table and one problem; each entry that fails :meth:`TunedEntry.from_dict` or
    ``check`` is dropped, one problem each."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return ReadResult(None, [])
    except OSError as exc:
        return ReadResult(None, [f"cannot read it ({exc.strerror or exc})"])
    try:
        if len(raw) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, expected an object")
        if data.get("schema") != SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA}")
        if data.get("identity") != identity:
            raise ValueError("it was tuned for another identity (GPU, versions, kernel or shapes)")
        if not isinstance(data.get("entries"), list):
            raise ValueError("no list of entries")
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; nesting: RecursionError
        return ReadResult(None, [str(exc) if not isinstance(exc, RecursionError) else "JSON nested too deeply"])
    entries, problems = [], []
    for i, item in enumerate(data["entries"]):
        try:
            entry = TunedEntry.from_dict(item)
            if check is not None:
                check(entry)
        except (ValueError, TypeError) as exc:
            problems.append(f"entry {i} dropped: {exc}")
            continue
        entries.append(entry)
    return ReadResult(TunedTable(identity, entries), problems)


def _warn_problems(path: Path, found: ReadResult) -> None:
    """One warning per read, however many entries were dropped."""
    if not found.problems:
        return
    if found.table is None:
        logger.warning("ignoring tuning file %s (%s); it will be rewritten", path, found.problems[0])
    else:
        more = f" and {len(found.problems) - 1} more" if len(found.problems) > 1 else ""
        logger.warning("tuning file %s: %s%s; it will be rewritten", path, found.problems[0], more)


def save_table(path: Path, table: TunedTable) -> None:
    """Atomic: write a temporary file beside ``path``, fsync, rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"schema": SCHEMA, "identity": table.identity, "entries": [e.as_dict() for e in table.entries]}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def acquire_lock(path: Path) -> IO:
    """An exclusive lock on ``path.lock`` (one tensor-parallel rank tunes, the rest wait),
    held until :func:`release_lock`. Raises ``OSError`` when the directory or the lock
    file cannot be created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(str(path) + ".lock", "a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
    except BaseException:
        handle.close()
        raise
    return handle


def release_lock(handle: IO) -> None:
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    finally:
        handle.close()


@dataclass
class Runner:
    """How to evaluate configs on one workload: ``run(config)`` returns the output tensor
    (on the same inputs every time); ``time(config)`` returns seconds for one call."""

    run: Callable[[Any], torch.Tensor]
    time: Callable[[Any], float]


def tune_workload(workload: Workload, default, candidates: Sequence, runner: Runner, *,
                  rounds: int = ROUNDS, min_speedup: float = MIN_SPEEDUP,
                  tolerance: float = VALIDATION_TOLERANCE) -> TunedEntry:
    """Validate every candidate against the default's output, time the survivors and the
    default in interleaved rounds, promote the fastest only on a clear win."""
    rejected = []
    try:
        expected = runner.run(default).float().clone()
    except Exception as exc:  # the table config itself fails: nothing to compare against
        raise RuntimeError(f"the table config fails on {workload}: {exc}") from exc
    if not torch.isfinite(expected).all():
        raise RuntimeError(f"the table config gives non-finite output on {workload}")
    valid = []
    for config in candidates:
        if config == default:
            continue
        try:
            out = runner.run(config)
        except Exception as exc:  # out of resources, compile errors: the candidate is dropped
            rejected.append(f"{config}: {type(exc).__name__}")
            continue
        err = relative_error(out.float(), expected)
        if not torch.isfinite(out.float()).all() or err > tolerance:
            rejected.append(f"{config}: output differs (rel err {err:.1e})")
            continue
        valid.append(config)
    contenders = [default] + valid
    samples: dict[int, list[float]] = {i: [] for i in range(len(contenders))}
    for r in range(rounds):
        order = list(range(len(contenders)))
        if r % 2:
            order.reverse()  # alternate the order so drift does not favour one side
        for i in order:
            samples[i].append(runner.time(contenders[i]))
    medians = [statistics.median(samples[i]) for i in range(len(contenders))]
    best_i = min(range(len(contenders)), key=lambda i: medians[i])
    speedup = medians[0] / medians[best_i] if medians[best_i] > 0 else 1.0
    if best_i == 0 or speedup < min_speedup:
        best_i, speedup = 0, 1.0
    return TunedEntry(workload=workload, default=_config_dict(default), best=_config_dict(contenders[best_i]),
                      default_us=medians[0] * 1e6, best_us=medians[best_i] * 1e6, speedup=speedup,
                      rejected=rejected)


def _config_dict(config) -> dict:
    return config.as_dict() if hasattr(config, "as_dict") else dict(config)


def tune(identity: dict[str, Any], workloads: Sequence[Workload], default_for: Callable[[Workload], Any],
         candidates_for: Callable[[Workload, Any], Sequence], runner_for: Callable[[Workload], Runner], *,
         path: Path | None = None, progress: Callable[[int, int, Workload], None] | None = None,
         min_speedup: float = MIN_SPEEDUP, rounds: int = ROUNDS, check: EntryCheck | None = None) -> TunedTable:
    """The table for ``identity`` covering ``workloads``: read without a lock when the
    file already covers them, else tune what is missing under the file lock and save.
    Never raises for a cache fault (see the module docstring); ``check`` validates
    every loaded entry (raise ``ValueError`` to drop it)."""
    path = path or table_path(identity)
    found = read_table(path, identity, check)
    if not found.dirty and found.table is not None and not _missing(found.table, workloads):
        return found.table
    try:
        lock = acquire_lock(path)
    except OSError as exc:  # no directory, no lock file: use what could be read, tune nothing
        also = f"; {found.problems[0]}" if found.problems else ""
        logger.warning("tuning cache %s is not usable (%s%s); workloads not in it use the table's configs",
                       path, exc, also)
        return found.table or TunedTable(identity, [])
    try:
        found = read_table(path, identity, check)  # another rank may have tuned meanwhile
        _warn_problems(path, found)
        table = found.table or TunedTable(identity, [])
        todo = _missing(table, workloads)
        for i, workload in enumerate(todo):
            if progress:
                progress(i, len(todo), workload)
            default = default_for(workload)
            try:
                entry = tune_workload(workload, default, candidates_for(workload, default), runner_for(workload),
                                      rounds=rounds, min_speedup=min_speedup)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                logger.warning("tuning skipped %s: %s", workload, exc)
                continue
            table.entries.append(entry)
        if todo or found.dirty:
            try:
                save_table(path, table)
            except OSError as exc:
                logger.warning("cannot save tuned launch configs to %s (%s); they serve this process only",
                               path, exc)
    finally:
        release_lock(lock)
    return table


def _missing(table: TunedTable, workloads: Sequence[Workload]) -> list[Workload]:
    done = {e.workload for e in table.entries}
    return [w for w in workloads if w not in done]
