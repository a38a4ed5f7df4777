"""Every malformed call is refused with a clear error before anything is written."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch

import dflash_rocm
from checks import bits
from strategies import make_generator, make_weights

BACKENDS = ["reference", "auto"]


def attention_args():
    g = make_generator(0, "cpu")
    q = torch.randn(6, 4, 16, generator=g)
    kc = torch.randn(8, 4, 2, 16, generator=g)
    vc = torch.randn(8, 4, 2, 16, generator=g)
    table = torch.tensor([[3, 1, 0], [2, 5, 7]], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 6], dtype=torch.int32)
    seq_lens = torch.tensor([9, 12], dtype=torch.int32)
    return dict(query=q, key_cache=kc, value_cache=vc, block_table=table, query_start_loc=qsl,
                seq_lens=seq_lens, out=torch.full_like(q, 7.0))


def mutate(args, **changes):
    new = dict(args)
    new.update(changes)
    return new


ATTENTION_BAD = [
    ("query 2-D", lambda a: mutate(a, query=a["query"][:, 0]), ValueError, "query"),
    ("query int", lambda a: mutate(a, query=a["query"].int()), TypeError, "query"),
    ("Hq % Hk", lambda a: mutate(a, key_cache=torch.zeros(8, 4, 3, 16), value_cache=torch.zeros(8, 4, 3, 16)),
     ValueError, "num_kv_heads=3"),
    ("head dim mismatch", lambda a: mutate(a, key_cache=torch.zeros(8, 4, 2, 8), value_cache=torch.zeros(8, 4, 2, 8)),
     ValueError, "head_dim=16"),
    ("value shape", lambda a: mutate(a, value_cache=torch.zeros(7, 4, 2, 16)), ValueError, "value_cache"),
    ("value dtype", lambda a: mutate(a, value_cache=a["value_cache"].half()), TypeError, "value_cache"),
    ("cache dtype", lambda a: mutate(a, key_cache=a["key_cache"].half(), value_cache=a["value_cache"].half()),
     TypeError, "key_cache"),
    ("float block table", lambda a: mutate(a, block_table=a["block_table"].float()), TypeError, "block_table"),
    ("ragged qsl", lambda a: mutate(a, query_start_loc=torch.tensor([0, 6], dtype=torch.int32)),
     ValueError, "query_start_loc"),
    ("qsl end", lambda a: mutate(a, query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32)),
     ValueError, "query_start_loc"),
    ("qsl decreasing", lambda a: mutate(a, query_start_loc=torch.tensor([0, 7, 6], dtype=torch.int32)),
     ValueError, "non-decreasing"),
    ("q_len > seq_len", lambda a: mutate(a, seq_lens=torch.tensor([2, 12], dtype=torch.int32)),
     ValueError, "seq_lens[0]"),
    ("block id past cache", lambda a: mutate(a, block_table=torch.tensor([[3, 1, 8], [2, 5, 7]], dtype=torch.int32)),
     ValueError, "block_table[0, 2]"),
    ("negative block id", lambda a: mutate(a, block_table=torch.tensor([[3, 1, 0], [-1, 5, 7]], dtype=torch.int32)),
     ValueError, "block_table[1, 0]"),
    ("seq past table", lambda a: mutate(a, seq_lens=torch.tensor([9, 13], dtype=torch.int32)),
     ValueError, "seq_lens[1]"),
    ("block table rows", lambda a: mutate(a, block_table=a["block_table"][:1]), ValueError, "block_table"),
    ("out shape", lambda a: mutate(a, out=torch.zeros(6, 4, 8)), ValueError, "out"),
    ("out dtype", lambda a: mutate(a, out=torch.zeros(6, 4, 16, dtype=torch.float16)), TypeError, "out"),
    ("sinks shape", lambda a: mutate(a, sinks=torch.zeros(2)), ValueError, "sinks"),
    ("sinks int", lambda a: mutate(a, sinks=torch.zeros(4, dtype=torch.int32)), TypeError, "sinks"),
    ("window 0", lambda a: mutate(a, sliding_window=0), ValueError, "sliding_window"),
    ("window float", lambda a: mutate(a, sliding_window=2.5), TypeError, "sliding_window"),
    ("causal str", lambda a: mutate(a, causal="yes"), TypeError, "causal"),
    ("scale nan", lambda a: mutate(a, scale=float("nan")), ValueError, "scale"),
    ("fp8 scale shape", lambda a: mutate(a, key_cache=a["key_cache"].to(torch.float8_e4m3fn),
                                         value_cache=a["value_cache"].to(torch.float8_e4m3fn),
                                         k_scale=torch.ones(3)), ValueError, "k_scale"),
    ("not a tensor", lambda a: mutate(a, seq_lens=[9, 12]), TypeError, "seq_lens"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,make,error,needle", ATTENTION_BAD, ids=[c[0] for c in ATTENTION_BAD])
def test_bad_attention_call_is_refused_before_any_write(name, make, error, needle, backend):
    args = make(attention_args())
    out_before = args["out"].clone()
    caches_before = [args["key_cache"].clone(), args["value_cache"].clone()]
    with pytest.raises(error) as info:
        dflash_rocm.draft_attention(**args, backend=backend)
    assert needle in str(info.value)
    assert torch.equal(args["out"], out_before), "out was written before the refusal"
    for before, now in zip(caches_before, (args["key_cache"], args["value_cache"])):
        assert torch.equal(bits(before), bits(now))


def test_error_names_expected_and_received_shape():
    args = mutate(attention_args(), value_cache=torch.zeros(7, 4, 2, 16))
    with pytest.raises(ValueError) as info:
        dflash_rocm.draft_attention(**args)
    message = str(info.value)
    assert "[8, 4, 2, 16]" in message and "[7, 4, 2, 16]" in message


def precompute_args(L=2):
    g = make_generator(1, "cpu")
    w = make_weights(g, "cpu", L=L, Hk=2, D=16, H=24, R=16, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.float32, max_position=64)
    N = 5
    return dict(context_states=torch.randn(N, 24, generator=g), positions=torch.arange(N),
                weights=w, key_caches=[torch.randn(3, 4, 2, 16, generator=g) for _ in range(L)],
                value_caches=[torch.randn(3, 4, 2, 16, generator=g) for _ in range(L)],
                slot_mapping=torch.tensor([0, 5, -1, 11, 2]))


PRECOMPUTE_BAD = [
    ("weights type", lambda a: mutate(a, weights={}), TypeError, "weights"),
    ("hidden mismatch", lambda a: mutate(a, context_states=torch.randn(5, 20)), ValueError, "context_states"),
    ("states dtype", lambda a: mutate(a, context_states=a["context_states"].half()), TypeError, "context_states"),
    ("positions length", lambda a: mutate(a, positions=torch.arange(4)), ValueError, "positions"),
    ("positions float", lambda a: mutate(a, positions=torch.arange(5.0)), TypeError, "positions"),
    ("position past rope table", lambda a: mutate(a, positions=torch.tensor([0, 1, 2, 3, 64])),
     ValueError, "max_position=64"),
    ("negative position", lambda a: mutate(a, positions=torch.tensor([0, -1, 2, 3, 4])), ValueError, "positions"),
    ("slot past cache", lambda a: mutate(a, slot_mapping=torch.tensor([0, 5, -1, 12, 2])),
     ValueError, "num_blocks*block_size=12"),
    ("slot below -1", lambda a: mutate(a, slot_mapping=torch.tensor([0, -2, -1, 1, 2])), ValueError, "slot"),
    ("slot length", lambda a: mutate(a, slot_mapping=torch.tensor([0, 1])), ValueError, "slot_mapping"),
    ("per-layer count", lambda a: mutate(a, slot_mapping=[torch.arange(5)]), ValueError, "slot_mapping"),
    ("cache count", lambda a: mutate(a, key_caches=a["key_caches"][:1]), ValueError, "key_caches"),
    ("cache heads", lambda a: mutate(a, key_caches=[torch.zeros(3, 4, 1, 16)] * 2), ValueError, "key_caches[0]"),
    ("cache dtype", lambda a: mutate(a, key_caches=[c.half() for c in a["key_caches"]],
                                     value_caches=[c.half() for c in a["value_caches"]]), TypeError, "key_caches[0]"),
    ("mixed cache dtypes", lambda a: mutate(a, key_caches=[a["key_caches"][0],
                                                            a["key_caches"][1].to(torch.float8_e4m3fn)]),
     TypeError, "key_caches[1]"),
    ("value shape", lambda a: mutate(a, value_caches=[torch.zeros(2, 4, 2, 16)] * 2), ValueError, "value_caches[0]"),
    ("missing cache", lambda a: mutate(a, key_caches=[None, a["key_caches"][1]]), ValueError, "key_caches[0]"),
    ("fp8 scales count", lambda a: mutate(a, key_caches=[c.to(torch.float8_e4m3fn) for c in a["key_caches"]],
                                          value_caches=[c.to(torch.float8_e4m3fn) for c in a["value_caches"]],
                                          k_scales=[1.0]), ValueError, "k_scales"),
    ("return_kv type", lambda a: mutate(a, return_kv=1), TypeError, "return_kv"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,make,error,needle", PRECOMPUTE_BAD, ids=[c[0] for c in PRECOMPUTE_BAD])
def test_bad_precompute_call_is_refused_before_any_write(name, make, error, needle, backend):
    args = make(precompute_args())
    before = [None if c is None else c.clone() for c in list(args["key_caches"]) + list(args["value_caches"])]
    with pytest.raises(error) as info:
        dflash_rocm.precompute_and_store_context_kv(**args, backend=backend)
    assert needle in str(info.value)
    after = list(args["key_caches"]) + list(args["value_caches"])
    for b, a in zip(before, after):
        if b is not None:
            assert torch.equal(bits(b), bits(a)), "a cache was written before the refusal"


def test_validate_false_skips_only_the_index_checks():
    """The opt-out is explicit and narrow: shapes are still checked, indices are not."""
    args = mutate(attention_args(), seq_lens=torch.tensor([2, 12], dtype=torch.int32))
    with pytest.raises(ValueError):
        dflash_rocm.draft_attention(**args)
    bad_shape = mutate(attention_args(), value_cache=torch.zeros(7, 4, 2, 16))
    with pytest.raises(ValueError):
        dflash_rocm.draft_attention(**bad_shape, validate=False)
    ok = attention_args()
    out = dflash_rocm.draft_attention(**ok, validate=False, backend="reference")
    assert torch.isfinite(out).all()


def test_weights_refuse_inconsistent_shapes():
    g = make_generator(2, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=2, D=16, H=24, R=8, is_neox=True, bias=True, v_scale=None,
                     dtype=torch.float32)
    fields = dict(hidden_norm_weight=w.hidden_norm_weight, kv_weight=w.kv_weight, kv_bias=w.kv_bias,
                  k_norm_weight=w.k_norm_weight, cos_sin_cache=w.cos_sin_cache, is_neox=True, eps=1e-6,
                  num_layers=2, num_kv_heads=2, head_dim=16)
    for change, needle in [(dict(num_layers=3), "kv_weight"), (dict(k_norm_weight=torch.ones(3, 16)), "k_norm_weight"),
                           (dict(cos_sin_cache=torch.ones(8, 7)), "cos_sin_cache"),
                           (dict(cos_sin_cache=torch.ones(8, 18)), "cos_sin_cache"),
                           (dict(hidden_norm_weight=torch.ones(23)), "hidden_norm_weight"),
                           (dict(kv_bias=torch.ones(3)), "kv_bias"), (dict(eps=0.0), "eps"),
                           (dict(eps=float("inf")), "eps"), (dict(eps=True), "eps"),
                           (dict(v_scale=float("nan")), "v_scale"), (dict(v_scale="2"), "v_scale"),
                           (dict(kv_weight=w.kv_weight.int()), "kv_weight"),
                           (dict(hidden_norm_weight=torch.ones(3, 24)), "hidden_norm_weight"),
                           (dict(hidden_norm_weight=torch.ones(2, 24, 1)), "hidden_norm_weight"),
                           (dict(rope_layers=(True,)), "rope_layers"), (dict(rope_layers=(1, 0)), "rope_layers"),
                           (dict(rope_layers=True), "rope_layers"),
                           (dict(round_k_before_rope=1), "round_k_before_rope")]:
        with pytest.raises((ValueError, TypeError)) as info:
            dflash_rocm.ContextKVWeights(**{**fields, **change})
        assert needle in str(info.value)


CORRUPTIONS = ["none", "first start", "num_tokens", "negative query length", "query past its sequence",
               "sequence past the table", "used block below 0", "used block past the cache", "unused block"]


@pytest.mark.parametrize("corruption", CORRUPTIONS)
@given(st.data())
def test_the_host_shortcut_of_the_attention_index_checks_passes_only_what_the_exact_checks_pass(corruption, data):
    """On host tensors a call's indices are first checked from two lists and one reduction
    (``_plainly_in_range``): valid indices pass it, and whatever it passes the exact checks
    pass too, so an index out of range never gets past it (anything it doubts goes to the
    exact checks, which name the offender or find the doubt unfounded)."""
    from dflash_rocm.ops.attention.validation import _exact_index_checks, _plainly_in_range
    from dflash_rocm.validation import IndexChecks

    B = data.draw(st.integers(2 if corruption == "negative query length" else 1, 4))
    bs, max_blocks, num_blocks = 4, data.draw(st.integers(2, 4)), data.draw(st.integers(2, 6))
    seq = data.draw(st.lists(st.integers(0, bs * max_blocks - bs), min_size=B, max_size=B))
    q_lens = [data.draw(st.integers(0, n)) for n in seq]
    table = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, num_blocks - 1), min_size=max_blocks,
                                                     max_size=max_blocks), min_size=B, max_size=B)))
    b = data.draw(st.integers(0, B - 1))
    if corruption == "negative query length":
        q_lens[b], q_lens[(b + 1) % B] = -1, q_lens[(b + 1) % B] + 1
    elif corruption == "query past its sequence":
        seq[b], q_lens[b] = max(seq[b] - 1, 0), max(q_lens[b], seq[b]) + 1
    elif corruption == "sequence past the table":
        seq[b] = bs * max_blocks + 1
    elif corruption in ("used block below 0", "used block past the cache"):
        seq[b] = max(seq[b], 1)
        table[b, data.draw(st.integers(0, (seq[b] - 1) // bs))] = -1 if "below" in corruption else num_blocks
    elif corruption == "unused block":
        table[b, -1] = -1  # no request uses its last column: seq <= bs * (max_blocks - 1)
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    qsl[0] += corruption == "first start"
    T = int(qsl[-1]) + (corruption == "num_tokens")
    seq_lens = torch.tensor(seq)
    shortcut = _plainly_in_range(qsl, seq_lens, table, T, num_blocks, bs)
    if corruption in ("none", "unused block"):
        _exact_index_checks(IndexChecks(torch.device("cpu")), qsl, seq_lens, table, T, num_blocks, bs)
        assert shortcut or corruption == "unused block"
    else:
        assert not shortcut
        with pytest.raises(ValueError):
            _exact_index_checks(IndexChecks(torch.device("cpu")), qsl, seq_lens, table, T, num_blocks, bs)
