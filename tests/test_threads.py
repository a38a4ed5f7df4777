"""Shared host state under concurrent callers (a server's worker threads)."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")


class YieldingInt(int):
    """An int whose hash gives up the GIL, so every dict operation on a key holding it
    can interleave with another thread's, as free-threaded and newer interpreters allow
    anywhere (CPython 3.11 happens to switch only at a few points)."""

    def __hash__(self):
        time.sleep(0)
        return int.__hash__(self)

    def __eq__(self, other):
        return int(self) == other


def test_the_precompute_cache_table_cache_is_thread_safe():
    from dflash_rocm.backends.triton import precompute

    def fake_cache(ptr):
        return SimpleNamespace(data_ptr=lambda: ptr, shape=(4, YieldingInt(16), 1, 8),
                               stride=lambda: (128, 8, 8, 1))

    def call_for(ptr):
        return SimpleNamespace(num_layers=1, key_caches=[fake_cache(ptr)], value_caches=[fake_cache(ptr + 4096)],
                               written_layers=(0,), device=torch.device("cpu"))

    # More cache sets than tables kept: lookups keep meeting evictions of their own key.
    calls = [call_for(4096 * (2 * i + 1)) for i in range(precompute._TABLES_KEPT + 4)]
    errors = []

    def worker(offset):
        try:
            for i in range(300):
                call = calls[(i * 7 + offset) % len(calls)]
                assert precompute.cache_table(call)[0, 0].item() == call.key_caches[0].data_ptr()
        except Exception as exc:  # collected: an exception in a thread would otherwise vanish
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(precompute._TABLES) <= precompute._TABLES_KEPT
