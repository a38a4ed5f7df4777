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

    call = SimpleNamespace(num_layers=1, key_caches=[fake_cache(4096)], value_caches=[fake_cache(8192)],
                           device=torch.device("cpu"))
    # More slot tensors than tables kept: lookups keep meeting evictions of their own key.
    slots = [torch.zeros(4, dtype=torch.int64) for _ in range(precompute._TABLES_KEPT + 4)]
    errors = []

    def worker(offset):
        try:
            for i in range(300):
                s = slots[(i * 7 + offset) % len(slots)]
                assert precompute.cache_table(call, [s])[0, 2].item() == s.data_ptr()
        except Exception as exc:  # collected: an exception in a thread would otherwise vanish
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(precompute._TABLES) <= precompute._TABLES_KEPT
