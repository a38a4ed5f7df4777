"""The tuner's logic on CPU with an injected timer: candidates, validation, promotion,
persistence, locking and corrupt files; then its use by the rocm backend and the CLI."""

import json
import logging
import threading
import time

import pytest
import torch

import dflash_rocm
from dflash_rocm import cli, tuning
from dflash_rocm.backends.rocm import settings, tables, tuner
from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig
from dflash_rocm.platform import simulate_platform
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
        assert "ignoring tuning file" in caplog.text and "rewritten" in caplog.text
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
    events = []

    def holder():
        with tuning.file_lock(path):
            events.append("held")
            time.sleep(0.3)
            events.append("released")

    t = threading.Thread(target=holder)
    t.start()
    while not events:
        time.sleep(0.01)
    with tuning.file_lock(path):
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
            source, config = rocm.attention_config(call)
            out = dflash_rocm.draft_attention(*args, backend="rocm")
        assert source == "tuned" and config == faster
        ref = dflash_rocm.draft_attention(*args, backend="reference")
        assert dflash_rocm.contract.relative_error(out, ref) < 2e-3
    finally:
        settings.configure(**previous.__dict__)


@needs_interpreter
def test_tune_command_prints_the_table(monkeypatch, capsys):
    def fake_runner(spec, w, device):
        return tuning.Runner(lambda c: torch.ones(4), lambda c: 0.5 if c.num_segments == 1 else 1.0)
    monkeypatch.setattr(tuner, "gpu_runner", fake_runner)
    previous = settings.current()
    try:
        rc = cli.main(["tune", "--simulate-arch", "gfx1201", "--batch-limit", "2", "--max-model-len", "2048"])
    finally:
        settings.configure(**previous.__dict__)
    captured = capsys.readouterr()
    assert rc == 0
    assert "gfx1201" in captured.out and "speed-up" in captured.out and "2/" in captured.err
    assert captured.out.count("\n") >= 6  # header + a row per (batch, span)


def test_tune_command_refuses_without_an_amd_gpu(capsys):
    assert cli.main(["tune"]) == 2
    assert "needs an AMD GPU" in capsys.readouterr().err
