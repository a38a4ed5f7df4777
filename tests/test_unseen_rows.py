"""Cache rows a query cannot see never reach its output, on every backend that runs here
(SPEC.md, "Rows no query sees").

Two requests share a batch: request 0 (6 keys, 3 queries, 2 pages of 4, then a stale
table entry) and request 1 (12 keys, 2 queries, 3 pages), so a backend that gathers
whole pages for the batch reads request 0's stale entry and its last page's tail. A
poisoned row must leave every row that cannot see it bit-identical to the clean call.
"""

import pytest
import torch

import dflash_rocm
from dflash_rocm.platform import simulate_platform
from support import needs_interpreter

BACKENDS = ["reference", "cpu", pytest.param("triton", marks=needs_interpreter),
            pytest.param("rocm", marks=needs_interpreter)]
FILLS = [float("nan"), float("inf"), float("-inf"), 1e38]
BLOCK = 4
TABLE = [[3, 5, 7], [1, 2, 0]]  # block 7: request 0's stale entry, owned by no request (nor are 4 and 6)
Q_LENS, SEQ_LENS = [3, 2], [6, 12]


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    Hk, G, D = 1, 2, 16
    query = torch.randn(sum(Q_LENS), Hk * G, D, generator=g)
    key_cache = torch.randn(8, BLOCK, Hk, D, generator=g)
    value_cache = torch.randn(8, BLOCK, Hk, D, generator=g)
    qsl = torch.tensor([0, Q_LENS[0], sum(Q_LENS)], dtype=torch.int32)
    return [query, key_cache, value_cache, torch.tensor(TABLE, dtype=torch.int32), qsl,
            torch.tensor(SEQ_LENS, dtype=torch.int32)]


def attend(args, backend, **kwargs):
    if backend == "rocm":
        with simulate_platform("gfx942"):
            return dflash_rocm.draft_attention(*args, **kwargs, backend=backend)
    return dflash_rocm.draft_attention(*args, **kwargs, backend=backend)


def key_row(j):
    """(block, row) of request 0's key ``j``."""
    return TABLE[0][j // BLOCK], j % BLOCK


# (rows of request 0's pages or the stale block, the call's masking): no query of request 0 sees them
UNSEEN = {
    "past_seq_len": ([key_row(6), key_row(7)], {}),
    "stale_page": ([(7, r) for r in range(BLOCK)], {}),
    "before_the_window": ([key_row(0), key_row(1)], dict(sliding_window=2)),  # positions 3-5 see keys 2-5
    "past_seq_len_causal": ([key_row(6), key_row(7)], dict(causal=True)),
    # each query sees only its own key: no key is seen by all three
    "before_a_window_of_one": ([key_row(0), key_row(1), key_row(2)], dict(causal=True, sliding_window=1)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", list(UNSEEN))
@pytest.mark.parametrize("cache", [1, 2], ids=["key", "value"])
@pytest.mark.parametrize("fill", FILLS)
def test_rows_no_query_sees_never_reach_the_output(backend, where, cache, fill):
    rows, kwargs = UNSEEN[where]
    args = batch()
    clean = attend(args, backend, **kwargs).clone()
    for block, row in rows:
        args[cache][block, row] = fill
    out = attend(args, backend, **kwargs)
    assert torch.isfinite(out).all()
    assert torch.equal(out, clean)


# (request 0's key, the call's masking, which of its 3 queries see the key)
HIDDEN_FROM_SOME = {
    "causality": (5, dict(causal=True), [False, False, True]),  # the last query's own key
    "the_window": (2, dict(sliding_window=2), [True, False, False]),  # only position 3's window reaches key 2
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hidden_by", list(HIDDEN_FROM_SOME))
def test_a_key_never_reaches_the_scores_of_a_query_that_cannot_see_it(backend, hidden_by):
    """Its key is selected out of those scores; the queries that see it see the NaN."""
    j, kwargs, seen = HIDDEN_FROM_SOME[hidden_by]
    args = batch()
    clean = attend(args, backend, **kwargs).clone()
    args[1][key_row(j)] = float("nan")
    out = attend(args, backend, **kwargs)
    for i, sees in enumerate(seen):
        if sees:
            assert torch.isnan(out[i]).all()
        else:
            assert torch.equal(out[i], clean[i])
    assert torch.equal(out[Q_LENS[0]:], clean[Q_LENS[0]:]), "request 1 never reads request 0's pages"
