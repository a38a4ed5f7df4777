"""SPEC rules that had no test of their own, on the backends CI runs (reference, cpu, triton
through the interpreter): fp8 stores saturate, one page layout per precompute call, calls
with zero requests or zero context tokens."""

import pytest
import torch

import dflash_rocm
from checks import bits
from dflash_rocm.contract import FP8_DTYPES
from dflash_rocm.paged import PackedCache, logical
from support import needs_interpreter
from test_validation import attention_args, precompute_args

BACKENDS = ["reference", "cpu", pytest.param("triton", marks=needs_interpreter)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FP8_DTYPES)
def test_fp8_stores_saturate_at_the_largest_finite_value(backend, fmt):
    """K/V far beyond the format's range over their scale are stored as +-its largest
    finite value (vLLM's reshape_and_cache_flash), never as NaN (a plain cast's)."""
    args = precompute_args()
    args["key_caches"] = [torch.zeros(3, 4, 2, 16, dtype=fmt) for _ in range(2)]
    args["value_caches"] = [torch.zeros(3, 4, 2, 16, dtype=fmt) for _ in range(2)]
    scales = [1e-4, 1e-4]
    k, v = dflash_rocm.precompute_and_store_context_kv(**{**args, "key_caches": None, "value_caches": None,
                                                          "slot_mapping": None}, return_kv=True,
                                                       backend="reference")
    dflash_rocm.precompute_and_store_context_kv(**args, k_scales=scales, v_scales=scales, backend=backend)
    largest = torch.finfo(fmt).max
    slots = args["slot_mapping"]
    keep = slots >= 0
    for caches, values in ((args["key_caches"], k), (args["value_caches"], v)):
        for layer, cache in enumerate(caches):
            stored = cache.view(-1, 2, 16)[slots[keep]].float()
            want = values[layer][keep] / scales[layer]
            assert not stored.isnan().any()
            beyond = want.abs() > 2 * largest  # (rows a backend computes a rounding apart stay far beyond)
            assert beyond.float().mean() > 0.5
            assert torch.equal(stored[beyond], largest * want[beyond].sign())


def test_fp8_saturation_is_the_format_s_largest_finite_code():
    """The largest finite value's code, as vLLM stores it: 0x7e for e4m3fn (0x7f is NaN),
    0x7f for e4m3fnuz (448 and 240)."""
    for fmt, code, value in ((torch.float8_e4m3fn, 0x7E, 448.0), (torch.float8_e4m3fnuz, 0x7F, 240.0)):
        assert torch.finfo(fmt).max == value
        assert torch.tensor([value]).to(fmt).view(torch.uint8).item() == code


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_precompute_call_with_more_than_one_page_layout_is_refused_before_any_write(backend):
    """Every written layer of one call uses one page layout for K and one for V: a plain
    layer beside an x-packed one is refused (ValueError) and nothing is written."""
    args = precompute_args()
    blocks, bs, hk, d = args["key_caches"][1].shape
    packed = PackedCache.x_packed_key(torch.zeros(blocks, hk, d // 4, bs, 4))
    args["key_caches"][1] = packed
    before = [bits(c).clone() for c in args["key_caches"] + args["value_caches"]]
    with pytest.raises(ValueError, match="every written layer must use one page layout"):
        dflash_rocm.precompute_and_store_context_kv(**args, backend=backend)
    assert all(torch.equal(b, bits(c)) for b, c in zip(before, args["key_caches"] + args["value_caches"]))
    assert logical(packed).abs().sum() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_attention_call_with_zero_requests_returns_an_empty_out(backend):
    args = attention_args()
    q = args["query"][:0]
    empty = dict(args, query=q, block_table=args["block_table"][:0], query_start_loc=args["query_start_loc"][:1],
                 seq_lens=args["seq_lens"][:0], out=None)
    caches = [args["key_cache"].clone(), args["value_cache"].clone()]
    out = dflash_rocm.draft_attention(**empty, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(caches[0], args["key_cache"]) and torch.equal(caches[1], args["value_cache"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_precompute_call_with_zero_context_tokens_writes_nothing(backend):
    args = precompute_args()
    empty = dict(args, context_states=args["context_states"][:0], positions=args["positions"][:0],
                 slot_mapping=args["slot_mapping"][:0])
    before = [c.clone() for c in args["key_caches"] + args["value_caches"]]
    k, v = dflash_rocm.precompute_and_store_context_kv(**empty, return_kv=True, backend=backend)
    assert k.shape == v.shape == (2, 0, 2, 16)
    assert all(torch.equal(b, c) for b, c in zip(before, args["key_caches"] + args["value_caches"]))
