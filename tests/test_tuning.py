"""The tuner's logic on CPU with an injected timer: candidates, validation, promotion,
persistence, locking and corrupt files; then its use by the rocm backend and the CLI."""

import contextlib
import json
from dataclasses import replace
import logging
import threading
import time

import pytest
import torch

from dflash_rocm.planning import record_for

import dflash_rocm
from dflash_rocm import cli, tuning
from dflash_rocm.backends.rocm import settings, tables, tuner
from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig
from dflash_rocm.ops import ATTENTION
from dflash_rocm.ops.attention import AttentionSpec
from dflash_rocm.platform import platform_for_arch, simulate_platform
from support import needs_interpreter

DEFAULT = AttentionLaunchConfig(block_m=32, block_n=64, num_segments=4, num_warps=4, num_stages=1, waves_per_eu=2)
W = tuning.Workload(batch=1, query_len=16, key_span=8192)
IDENTITY = {"arch": "gfx1100", "head_dim": 128}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_ROCM_CACHE_DIR", str(tmp_path / "cache"))
    tuner.forget_tables()
    yield tmp_path / "cache"
    tuner.forget_tables()


class FakeRunner:
    """Outputs and times per config; counts what was evaluated."""

    def __init__(self, times, wrong=(), broken=(), noise=None):
        self.times, self.wrong, self.broken, self.noise = times, set(wrong), set(broken), noise or {}
        self.runs, self.timed = [], []
        self.expected = torch.linspace(-1, 1, 64)

    def run(self, config):
        self.runs.append(config)
        if config in self.broken:
            raise RuntimeError("out of resources")
        return self.expected * (1.5 if config in self.wrong else 1.0)

    def time(self, config):
        self.timed.append(config)
        samples = self.noise.get(config)
        if samples:
            return samples.pop(0)
        return self.times.get(config, 1.0)

    def runner(self):
        return tuning.Runner(self.run, self.time)


def test_candidates_are_single_changes_around_the_table_config():
    cands = tuner.candidates(DEFAULT, group=4)
    assert DEFAULT not in cands and len(cands) == len(set(cands))
    assert {c.num_segments for c in cands} >= {8, 2, 1, 4}
    assert all(c.block_m >= 4 for c in cands)
    assert all(sum(getattr(c, f) != getattr(DEFAULT, f) for f in DEFAULT.__dataclass_fields__) == 1 for c in cands)
    assert all(c.block_m >= 16 for c in tuner.candidates(DEFAULT, group=16))
    # A table's 32-row mergers (a 16-head group, twice one token's rows): no candidate tile
    # smaller than a merger's rows (it would not be a valid config).
    split = AttentionLaunchConfig(block_m=64, num_segments=16, merge="tail", merge_rows=32)
    assert {c.block_m for c in tuner.candidates(split, group=16)} == {32, 64, 128}


def test_a_clear_win_is_promoted():
    fast = tuner.candidates(DEFAULT, 4)[0]
    fake = FakeRunner({DEFAULT: 1.0, fast: 0.9})
    entry = tuning.tune_workload(W, DEFAULT, tuner.candidates(DEFAULT, 4), fake.runner())
    assert entry.best == fast.as_dict() and entry.speedup == pytest.approx(1 / 0.9)


def test_a_small_win_is_not_promoted():
    fast = tuner.candidates(DEFAULT, 4)[0]
    fake = FakeRunner({DEFAULT: 1.0, fast: 0.99})
    entry = tuning.tune_workload(W, DEFAULT, tuner.candidates(DEFAULT, 4), fake.runner())
    assert entry.best == DEFAULT.as_dict() and entry.speedup == 1.0


def test_a_wrong_or_failing_candidate_is_never_promoted_however_fast():
    wrong, broken = tuner.candidates(DEFAULT, 4)[:2]
    fake = FakeRunner({DEFAULT: 1.0, wrong: 0.1, broken: 0.1}, wrong=[wrong], broken=[broken])
    entry = tuning.tune_workload(W, DEFAULT, [wrong, broken], fake.runner())
    assert entry.best == DEFAULT.as_dict()
    assert len(entry.rejected) == 2 and "output differs" in " ".join(entry.rejected)
    assert wrong not in fake.timed and broken not in fake.timed


def test_medians_over_rounds_ignore_one_lucky_sample():
    lucky = tuner.candidates(DEFAULT, 4)[0]
    fake = FakeRunner({DEFAULT: 1.0}, noise={lucky: [0.5, 1.2, 1.1]})
    entry = tuning.tune_workload(W, DEFAULT, [lucky], fake.runner(), rounds=3)
    assert entry.best == DEFAULT.as_dict()


def test_the_default_must_itself_be_sound():
    fake = FakeRunner({}, broken=[DEFAULT])
    with pytest.raises(RuntimeError, match="table config fails"):
        tuning.tune_workload(W, DEFAULT, [], fake.runner())


def _tune(fake, workloads=(W,), identity=IDENTITY):
    return tuning.tune(identity, list(workloads), lambda w: DEFAULT, lambda w, d: tuner.candidates(d, 4),
                       lambda w: fake.runner())


def test_results_persist_and_are_reused(cache_dir):
    fast = tuner.candidates(DEFAULT, 4)[0]
    table = _tune(FakeRunner({DEFAULT: 1.0, fast: 0.5}))
    path = tuning.table_path(IDENTITY)
    data = json.loads(path.read_text())
    assert data["identity"] == IDENTITY and data["entries"][0]["best"] == fast.as_dict()
    again = FakeRunner({})
    reloaded = _tune(again)
    assert again.runs == [] and reloaded.entries[0].best == table.entries[0].best
    assert not list(path.parent.glob("*.tmp")), "atomic write left a temporary file"


def test_corrupt_and_foreign_files_are_ignored_with_a_warning_and_rewritten(cache_dir, caplog):
    path = tuning.table_path(IDENTITY)
    for bad in ("{not json", json.dumps({"schema": 1, "identity": {"arch": "gfx942"}, "entries": []}),
                json.dumps({"schema": 99, "identity": IDENTITY, "entries": []}),
                json.dumps({"schema": 1, "identity": IDENTITY, "entries": [{"workload": 3}]})):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dflash_rocm"):
            table = _tune(FakeRunner({DEFAULT: 1.0}))
        assert str(path) in caplog.text and "rewritten" in caplog.text
        assert len(table.entries) == 1
        assert json.loads(path.read_text())["identity"] == IDENTITY


def test_lookup_takes_the_smallest_covering_workload():
    entries = [tuning.TunedEntry(tuning.Workload(b, 16, s), {}, {"tag": f"{b}-{s}"}, 1, 1, 1.0)
               for b in (1, 4) for s in (1024, 8192)]
    table = tuning.TunedTable(IDENTITY, entries)
    assert table.lookup(1, 16, 1000) == {"tag": "1-1024"}
    assert table.lookup(2, 16, 2000) == {"tag": "4-8192"}
    assert table.lookup(1, 17, 100) is None and table.lookup(8, 16, 100) is None


def test_the_file_lock_serialises_ranks(cache_dir):
    path = tuning.table_path(IDENTITY)
    events, held = [], threading.Event()

    def holder():
        lock = tuning.acquire_lock(path)
        events.append("held")
        held.set()
        time.sleep(0.3)
        events.append("released")
        tuning.release_lock(lock)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(timeout=30)
    tuning.release_lock(tuning.acquire_lock(path))
    events.append("second")
    t.join()
    assert events == ["held", "released", "second"]


def test_concurrent_ranks_tune_once(cache_dir):
    fakes = [FakeRunner({DEFAULT: 1.0}) for _ in range(3)]
    threads = [threading.Thread(target=_tune, args=(f,)) for f in fakes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(bool(f.runs) for f in fakes) == [False, False, True]


def test_workloads_are_bounded_by_the_limits():
    ws = tuner.workloads(query_limit=16, batch_limit=8, max_model_len=20000)
    assert {w.query_len for w in ws} == {16}
    assert max(w.batch for w in ws) == 8 and max(w.key_span for w in ws) == 20000
    windowed = tuner.workloads(query_limit=16, batch_limit=1, max_model_len=20000, sliding_window=512)
    assert max(w.key_span for w in windowed) == 527


@needs_interpreter
def test_rocm_backend_uses_the_tuned_config(monkeypatch):
    from test_triton_backend import paged
    from dflash_rocm.backends import rocm
    from dflash_rocm.ops.attention import attention_call

    monkeypatch.setenv("DFLASH_ROCM_TUNE", "1")
    previous = settings.current()
    settings.configure(batch_limit=1, max_model_len=64, query_limit=4)
    try:
        args = paged([60], [4], Hk=1, G=2, D=32, block_size=16)
        with simulate_platform("gfx1100") as platform:
            call = attention_call(*args)
            spec = call.spec
            default = tables.segmented_config(rocm.attention_workload(call, platform))[1]
            faster = AttentionLaunchConfig(**{**default.as_dict(), "block_n": 16})
            real = tuner.gpu_runner  # validation runs the real kernel; only the clock is fake

            def runner_for(w):
                r = real(spec, w, torch.device("cpu"))
                return tuning.Runner(r.run, lambda c: 0.5 if c == faster else 1.0)

            monkeypatch.setattr(tuner, "candidates", lambda d, g: [faster])
            tuner.tune_attention(platform, spec, torch.device("cpu"), runner_for=runner_for)
            source, config = rocm.attention_choice(*record_for("draft_attention", "rocm", call))
            out = dflash_rocm.draft_attention(*args, backend="rocm")
        assert source == "tuned" and config == faster
        ref = dflash_rocm.draft_attention(*args, backend="reference")
        assert dflash_rocm.contract.relative_error(out, ref) < 2e-3
    finally:
        settings.configure(**previous._asdict())


@needs_interpreter
def test_tune_command_prints_the_table(monkeypatch, capsys):
    def fake_runner(spec, w, device):
        return tuning.Runner(lambda c: torch.ones(4), lambda c: 0.5 if c.num_segments == 1 else 1.0)
    monkeypatch.setattr(tuner, "gpu_runner", fake_runner)
    previous = settings.current()
    try:
        rc = cli.main(["tune", "--simulate-arch", "gfx1201", "--batch-limit", "2", "--max-model-len", "2048"])
    finally:
        settings.configure(**previous._asdict())
    captured = capsys.readouterr()
    assert rc == 0
    assert "gfx1201" in captured.out and "speed-up" in captured.out and "2/" in captured.err
    assert "interpreter timings on a CPU" in " ".join(captured.out.split())  # never read as a GPU's speed-up
    assert captured.out.count("\n") >= 6  # header + a row per (batch, span)


def test_tune_command_refuses_without_an_amd_gpu(capsys):
    assert cli.main(["tune"]) == 2
    assert "needs an AMD GPU" in capsys.readouterr().err


# -- cache faults, entry validation, concurrent writers, lookups (issue 16) ----------------------

ATTN_ARGS = None  # built on first use: paged() lives in a module that needs the interpreter


def attn_args():
    global ATTN_ARGS
    if ATTN_ARGS is None:
        from test_triton_backend import paged
        ATTN_ARGS = paged([60], [4], Hk=1, G=2, D=32, block_size=16)
    return ATTN_ARGS


def fast_warps_runner(spec, w, device):
    """Every config gives the same output; 8 warps times "faster" (the table says 4)."""
    return tuning.Runner(lambda c: torch.ones(4), lambda c: 0.5 if c.num_warps == 8 else 1.0)


@pytest.fixture
def rdna(monkeypatch):
    """A simulated gfx1100 with tuning on, a one-workload tuning space (batch 1, query 4,
    keys 64) and a fake GPU runner: tuning is instant and promotes ``num_warps=8``."""
    monkeypatch.setenv("DFLASH_ROCM_TUNE", "1")
    monkeypatch.setattr(tuner, "gpu_runner", fast_warps_runner)
    previous = settings.current()
    settings.configure(batch_limit=1, max_model_len=64, query_limit=4)
    try:
        with simulate_platform("gfx1100") as platform:
            yield platform
    finally:
        settings.configure(**previous._asdict())


def spec_of_args():
    from dflash_rocm.ops.attention import attention_call
    return attention_call(*attn_args()).spec


def serve(times=3, warm_up=True):
    """Attention calls through the rocm backend (after its warm-up, which tunes, unless
    ``warm_up`` is False), each checked against the reference."""
    from dflash_rocm.backends import rocm
    from dflash_rocm.ops.attention import attention_call

    if warm_up:
        rocm.RocmBackend.warm_up(ATTENTION, spec_of_args(), torch.device("cpu"))
    ref = dflash_rocm.draft_attention(*attn_args(), backend="reference")
    for _ in range(times):
        out = dflash_rocm.draft_attention(*attn_args(), backend="rocm")
        assert dflash_rocm.contract.relative_error(out, ref) < 2e-3
    return rocm.attention_choice(*record_for("draft_attention", "rocm", attention_call(*attn_args())))


def warnings_about(caplog, text):
    return [r for r in caplog.records if r.name == "dflash_rocm" and r.levelno >= logging.WARNING
            and text in r.getMessage()]


@contextlib.contextmanager
def read_only(directory):
    """``directory`` read-only inside the block. Root ignores permission bits, so under
    root every write-mode open, create, mkdir and rename inside it also fails with EACCES,
    as it would for anyone else."""
    import builtins
    import errno
    import os

    def chmod_all(dirs, files):
        for p in [directory, *directory.rglob("*")]:
            p.chmod(dirs if p.is_dir() else files)

    root = str(directory.resolve())

    def inside(path):
        try:
            return os.path.realpath(os.fspath(path)).startswith(root + os.sep)
        except TypeError:  # a file descriptor
            return False

    def denied(path):
        return PermissionError(errno.EACCES, "Permission denied", os.fspath(path))

    real_open, real_os_open, real_mkdir, real_replace = builtins.open, os.open, os.mkdir, os.replace

    def guarded_open(file, mode="r", *args, **kwargs):
        if inside(file) and any(c in mode for c in "wax+"):
            raise denied(file)
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise denied(path)
        return real_os_open(path, flags, *args, **kwargs)

    def guarded_mkdir(path, *args, **kwargs):
        if inside(path):
            raise denied(path)
        return real_mkdir(path, *args, **kwargs)

    def guarded_replace(src, dst, *args, **kwargs):
        if inside(dst):
            raise denied(dst)
        return real_replace(src, dst, *args, **kwargs)

    chmod_all(0o555, 0o444)
    try:
        with pytest.MonkeyPatch.context() as mp:
            if os.geteuid() == 0:
                mp.setattr(builtins, "open", guarded_open)
                mp.setattr(os, "open", guarded_os_open)
                mp.setattr(os, "mkdir", guarded_mkdir)
                mp.setattr(os, "replace", guarded_replace)
            yield
    finally:
        chmod_all(0o755, 0o644)


def _table_path(platform):
    return tuner.last_path(spec_of_args(), platform)


def _fault_file_is_cache_dir(cache_dir, path, identity):
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    cache_dir.write_text("not a directory")


def _fault_json(text):
    def write(cache_dir, path, identity):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text(identity) if callable(text) else text)
    return write


def _fault_lock_is_a_directory(cache_dir, path, identity):
    (path.parent / (path.name + ".lock")).mkdir(parents=True)


CACHE_FAULTS = {
    "cache dir is a file": _fault_file_is_cache_dir,
    "file holds a JSON list": _fault_json("[1, 2, 3]"),
    "file holds deeply nested JSON": _fault_json("[" * 200_000 + "]" * 200_000),
    "file holds a string": _fault_json('"entries"'),
    "entries are not a list": _fault_json(lambda ident: json.dumps({"schema": 1, "identity": ident, "entries": {}})),
    "lock file cannot be created": _fault_lock_is_a_directory,
}


@needs_interpreter
@pytest.mark.parametrize("fault", list(CACHE_FAULTS))
def test_a_cache_fault_never_fails_an_attention_call_and_warns_once(fault, rdna, cache_dir, caplog):
    path = _table_path(rdna)
    CACHE_FAULTS[fault](cache_dir, path, tuner.identity(rdna, spec_of_args(), settings.effective_query_limit()))
    with caplog.at_level(logging.WARNING, logger="dflash_rocm"):
        serve(times=3)
    named = warnings_about(caplog, str(path))
    assert len(named) == 1, [r.getMessage() for r in caplog.records]
    assert len(warnings_about(caplog, "")) == 1


@needs_interpreter
def test_a_read_only_cache_holding_a_valid_table_is_used_without_a_warning(rdna, cache_dir, caplog):
    serve(times=1)  # tunes and saves: num_warps=8 wins
    tuner.forget_tables()
    with read_only(cache_dir), caplog.at_level(logging.WARNING, logger="dflash_rocm"):
        source, config = serve(times=3)
    assert source == "tuned" and config.num_warps == 8
    assert not warnings_about(caplog, "")


@needs_interpreter
def test_a_read_only_cache_without_a_table_falls_back_to_the_table_with_one_warning(rdna, cache_dir, caplog):
    cache_dir.mkdir(parents=True)
    with read_only(cache_dir), caplog.at_level(logging.WARNING, logger="dflash_rocm"):
        source, _ = serve(times=3)
    assert source != "tuned"
    assert len(warnings_about(caplog, str(_table_path(rdna)))) == 1
    assert len(warnings_about(caplog, "")) == 1


@needs_interpreter
def test_a_plan_never_tunes_and_finds_what_warm_up_tuned(rdna, monkeypatch):
    """Tuning happens in warm-up (and ``dflash-rocm tune``) only: calls before it get the
    table's config and start no tuner; after it, the next call's plan (a new record: the
    tables' generation moved) gets the tuned config."""
    runners = []
    monkeypatch.setattr(tuner, "gpu_runner", lambda *a: runners.append(1) or fast_warps_runner(*a))
    source, _ = serve(times=2, warm_up=False)
    assert source != "tuned" and not runners
    source, config = serve(times=1)
    assert source == "tuned" and config.num_warps == 8 and runners


@needs_interpreter
def test_a_table_tuned_under_other_engine_settings_is_not_used(rdna):
    """A tuned table is kept under the engine settings and cache directory it was tuned
    under: a plan under another batch limit, model length or cache directory gets the
    table's config until warm-up tunes for those settings."""
    source, _ = serve(times=1)
    assert source == "tuned"
    for change in (dict(batch_limit=2), dict(max_model_len=128)):
        previous = settings.current()
        settings.configure(**change)
        try:
            assert serve(times=1, warm_up=False)[0] != "tuned", change
        finally:
            settings.configure(**previous._asdict())
    with pytest.MonkeyPatch.context() as m:
        m.setenv("DFLASH_ROCM_CACHE_DIR", str(tuning.cache_dir()) + "-other")
        assert serve(times=1, warm_up=False)[0] != "tuned"
    assert serve(times=1, warm_up=False)[0] == "tuned"


def _entry_with(**best):
    entry = tuning.TunedEntry(tuning.Workload(1, 4, 64), DEFAULT.as_dict(), {**DEFAULT.as_dict(), **best},
                              1.0, 0.5, 2.0).as_dict()
    for key, value in best.items():
        if value is KeyError:
            del entry["best"][key]
    return entry


BAD_ENTRIES = {
    "block_m 8": _entry_with(block_m=8),
    "block_n 48": _entry_with(block_n=48),
    "block_m 4096": _entry_with(block_m=4096),
    "unknown key": _entry_with(swizzle=2),
    "missing key": _entry_with(num_stages=KeyError),
    "string for an int": _entry_with(num_warps="4"),
    "bool for an int": _entry_with(num_stages=True),
    "float for an int": _entry_with(block_n=64.0),
    "too many segments for RDNA": _entry_with(num_segments=64),
    "no segments": _entry_with(num_segments=0),
    "3 warps": _entry_with(num_warps=3),
    "0 stages": _entry_with(num_stages=0),
    "negative waves": _entry_with(waves_per_eu=-1),
    "unknown merge": _entry_with(merge="spin"),
    "bool merge (the old field's type)": _entry_with(merge=True),
    "merge_rows 3": _entry_with(merge_rows=3),
    "int for fp16_dots": _entry_with(fp16_dots=1),
    "int for fp8_k_at_load": _entry_with(fp8_k_at_load=0),
    "workload with a string": {**_entry_with(), "workload": {"batch": "1", "query_len": 4, "key_span": 64}},
    "negative speed-up": {**_entry_with(), "speedup": -1.0},
    "entry is a list": [1, 2],
    "best is a list": {**_entry_with(), "best": [16, 64]},
}


@needs_interpreter
@pytest.mark.parametrize("bad", list(BAD_ENTRIES))
def test_a_bad_entry_is_dropped_with_a_warning_and_the_file_rewritten(bad, rdna, cache_dir, caplog):
    path = _table_path(rdna)
    serve(times=1)
    data = json.loads(path.read_text())
    data["entries"] = [BAD_ENTRIES[bad]]
    path.write_text(json.dumps(data))
    tuner.forget_tables()
    with caplog.at_level(logging.WARNING, logger="dflash_rocm"):
        source, config = serve(times=3)
    named = warnings_about(caplog, str(path))
    assert len(named) == 1 and "dropped" in named[0].getMessage().replace(str(path), "")
    rewritten = json.loads(path.read_text())["entries"]
    assert len(rewritten) == 1 and rewritten[0]["best"]["num_warps"] == 8  # tuned again, valid
    assert source == "tuned" and config.num_warps == 8


@pytest.mark.parametrize("field,value,group,words", [
    ("block_m", 16, 32, "GQA group"), ("num_segments", 33, 1, "1..32 on rdna"), ("waves_per_eu", 99, 1, "0..16"),
    ("num_stages", 99, 1, "1..8"), ("block_n", 512, 1, "16..256")])
def test_launch_config_checks_bounds(field, value, group, words):
    with pytest.raises(ValueError, match=words):
        tuner.launch_config_from_dict({**DEFAULT.as_dict(), field: value}, group, "rdna")
    assert tuner.launch_config_from_dict(DEFAULT.as_dict(), 4, "rdna") == DEFAULT


@needs_interpreter
def test_a_tuned_config_that_fails_to_launch_is_dropped_and_the_call_served(rdna, caplog, monkeypatch):
    from dflash_rocm.backends import rocm

    real = rocm.plan_attention
    failed = []

    class FailsToLaunch:
        def __init__(self, config):
            self.config = config

        def run(self, call):
            failed.append(self.config)
            raise RuntimeError("out of resources: shared memory")

    def plan(record, facts, config):
        return FailsToLaunch(config) if config.num_warps == 8 else real(record, facts, config)

    monkeypatch.setattr(rocm, "plan_attention", plan)
    with caplog.at_level(logging.WARNING, logger="dflash_rocm"):
        source, _ = serve(times=3)
    assert len(failed) == 1 and source != "tuned"
    assert len(warnings_about(caplog, "failed")) == 1


@needs_interpreter
def test_the_identity_is_built_once_per_spec(rdna, monkeypatch):
    calls = []
    real = tuner.identity
    monkeypatch.setattr(tuner, "identity", lambda *a: calls.append(a) or real(*a))
    tuner.cached_identity.cache_clear()
    serve(times=4)
    assert len(calls) == 1


def _tune_in_process(path, batches, barrier):
    barrier.wait()
    workloads = [tuning.Workload(b, 16, 8192) for b in batches]
    tuning.tune(IDENTITY, workloads, lambda w: DEFAULT, lambda w, d: tuner.candidates(d, 4),
                lambda w: FakeRunner({DEFAULT: 1.0}).runner(), path=path, rounds=1)


def _read_while_written(path, stop, torn):
    while not stop.is_set():
        try:
            data = json.loads(path.read_text())
            assert data["identity"] == IDENTITY and isinstance(data["entries"], list)
        except FileNotFoundError:
            continue
        except Exception:
            torn.value += 1


def test_concurrent_writer_processes_lose_no_update_and_leave_no_torn_file(cache_dir):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    path = tuning.table_path(IDENTITY)
    writers = 4
    barrier, stop, torn = ctx.Barrier(writers), ctx.Event(), ctx.Value("i", 0)
    reader = ctx.Process(target=_read_while_written, args=(path, stop, torn))
    reader.start()
    procs = [ctx.Process(target=_tune_in_process, args=(path, [2 * k + 1, 2 * k + 2], barrier))
             for k in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    stop.set()
    reader.join(timeout=30)
    assert [p.exitcode for p in procs] == [0] * writers
    batches = sorted(e["workload"]["batch"] for e in json.loads(path.read_text())["entries"])
    assert batches == list(range(1, 2 * writers + 1))
    assert torn.value == 0 and not list(path.parent.glob("*.tmp"))


def _brute_force(entries, b, q, s):
    covering = [e for e in entries if e[0].batch >= b and e[0].query_len >= q and e[0].key_span >= s]
    if not covering:
        return None
    return min(covering, key=lambda e: (e[0].query_len, e[0].batch, e[0].key_span))[1]


def test_the_workload_index_finds_what_a_scan_finds():
    from hypothesis import given
    from hypothesis import strategies as st

    sizes = st.sampled_from([1, 2, 4, 16, 64, 1024, 8192])

    @given(st.lists(st.tuples(sizes, sizes, sizes), max_size=12, unique=True), sizes, sizes, sizes)
    def check(workloads, b, q, s):
        entries = [(tuning.Workload(*w), i) for i, w in enumerate(workloads)]
        assert tuning.WorkloadIndex(entries).find(b, q, s) == _brute_force(entries, b, q, s)

    check()


def test_tuned_candidates_stay_within_what_the_entry_check_accepts(monkeypatch):
    """RDNA's tables split keys at most 32 ways: a 64-way candidate would be tuned, then
    dropped by the check on every load."""
    rdna_default = AttentionLaunchConfig(block_m=16, block_n=64, num_segments=32, num_warps=4, num_stages=1,
                                         waves_per_eu=2)
    offered = []

    def fake_tune(identity, workloads, default_for, candidates_for, runner_for, **kwargs):
        offered.extend(candidates_for(workloads[0], rdna_default))
        return tuning.TunedTable(identity, [])

    monkeypatch.setattr(tuning, "tune", fake_tune)
    spec = AttentionSpec(32, 2, 128, 16, torch.bfloat16, torch.bfloat16, False, None, False)
    tuner.tune_attention(platform_for_arch("gfx1100"), spec, torch.device("cpu"))
    assert offered and max(c.num_segments for c in offered) == 32
    for c in offered:
        assert tuner.launch_config_from_dict(c.as_dict(), 16, "rdna") == c


def test_gfx12_pipelined_candidates_are_neither_tuned_nor_loaded(monkeypatch):
    """gfx12 keeps loops single-stage (Triton's pipelined buffer loads gave wrong results
    there on hardware, vLLM #62697): the tuner offers no two-stage candidate on gfx1201, and
    a two-stage entry in a cached table is refused by the entry check (RDNA3 may take it)."""
    default = AttentionLaunchConfig(block_m=64, block_n=32, num_segments=8, num_warps=4, num_stages=1)
    offered = []

    def fake_tune(identity, workloads, default_for, candidates_for, runner_for, check, **kwargs):
        offered.append((candidates_for(workloads[0], default), check))
        return tuning.TunedTable(identity, [])

    monkeypatch.setattr(tuning, "tune", fake_tune)
    spec = AttentionSpec(32, 8, 128, 16, torch.bfloat16, torch.bfloat16, False, None, False)
    piped = replace(default, num_stages=2)
    entry = tuning.TunedEntry(tuning.Workload(1, 16, 8192), default.as_dict(), piped.as_dict(), 12.0, 10.0, 1.2)
    for arch, allowed in (("gfx1201", False), ("gfx1100", True)):
        offered.clear()
        tuner.tune_attention(platform_for_arch(arch), spec, torch.device("cpu"))
        (candidates, check), = offered
        assert (piped in candidates) == allowed
        if allowed:
            check(entry)
        else:
            with pytest.raises(ValueError, match="num_stages"):
                check(entry)
