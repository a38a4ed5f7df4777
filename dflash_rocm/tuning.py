"""Startup tuning of launch configurations: search, validate, promote, persist.

For each workload (batch, query length, key span) the tuner times a few candidates
around the table's choice. A candidate is considered only after its output matches the
table config's output on the same inputs, and replaces it only on a clear win: the
incumbent's median time over the candidate's, across repeated rounds, must reach
``min_speedup``. Winners are kept as JSON under ``DFLASH_ROCM_CACHE_DIR`` (default
``$XDG_CACHE_HOME/dflash_rocm``), one file per identity (architecture, versions, kernel
source, dtypes, heads, page size, causal, window, sinks, query limit). Writes are
atomic; a file lock serialises tensor-parallel ranks (the first tunes, the others wait
and read its file); a corrupt or foreign file is ignored with a warning and rewritten.

Everything device-specific (running a config, timing it) is injected, so the logic is
tested on CPU with a fake timer.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from . import envs
from .contract import relative_error

logger = logging.getLogger("dflash_rocm")

SCHEMA = 1
MIN_SPEEDUP = 1.03  # a clear win: 3% faster by paired medians
VALIDATION_TOLERANCE = 5e-3  # relative error against the table config's output
ROUNDS = 3


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
    def from_dict(cls, d: dict) -> "TunedEntry":
        return cls(workload=Workload(**d["workload"]), default=dict(d["default"]), best=dict(d["best"]),
                   default_us=d.get("default_us"), best_us=d.get("best_us"), speedup=float(d["speedup"]),
                   rejected=list(d.get("rejected", [])))


@dataclass
class TunedTable:
    identity: dict[str, Any]
    entries: list[TunedEntry]

    def lookup(self, batch: int, query_len: int, key_span: int) -> dict | None:
        """The tuned config of the smallest tuned workload that covers this call (ceiling
        bucket on batch, query length and key span); None when the call is larger than
        anything tuned (the table's own config then applies)."""
        covering = [e for e in self.entries
                    if e.workload.batch >= batch and e.workload.query_len >= query_len
                    and e.workload.key_span >= key_span]
        if not covering:
            return None
        best = min(covering, key=lambda e: (e.workload.query_len, e.workload.batch, e.workload.key_span))
        return best.best


def load_table(path: Path, identity: dict[str, Any]) -> TunedTable | None:
    """The table at ``path``, or None (with a warning) when it is corrupt or foreign."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA}")
        if data.get("identity") != identity:
            raise ValueError("it was tuned for another identity (GPU, versions, kernel or shapes)")
        entries = [TunedEntry.from_dict(e) for e in data["entries"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring tuning file %s (%s); it will be rewritten", path, exc)
        return None
    return TunedTable(identity, entries)


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


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock on ``path.lock``: one tensor-parallel rank tunes, the rest wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


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
         min_speedup: float = MIN_SPEEDUP, rounds: int = ROUNDS) -> TunedTable:
    """Load the table for ``identity`` or tune the missing workloads and save it, under
    the file lock. Returns the table."""
    path = path or table_path(identity)
    with file_lock(path):
        table = load_table(path, identity) or TunedTable(identity, [])
        done = {e.workload for e in table.entries}
        todo = [w for w in workloads if w not in done]
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
        if todo:
            save_table(path, table)
    return table
