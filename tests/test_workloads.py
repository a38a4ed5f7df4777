"""The input builders of ``dflash_rocm.workloads`` take the dtype names the docs and the
command line use ("bf16", "fp8", ...), and refuse any other name saying what they accept."""

import pytest
import torch

from dflash_rocm.contract import DTYPE_NAMES
from dflash_rocm.workloads import SHAPES, attention_inputs, precompute_inputs

SHAPE = SHAPES["qwen3-8b-dflash-b16"].scaled_for_cpu()


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32),
                                        ("BF16", torch.bfloat16), ("bfloat16", torch.bfloat16)])
def test_attention_inputs_take_dtype_names(name, dtype):
    a = attention_inputs(SHAPE, batch=1, context_len=8, dtype=name, cache_dtype=name, device="cpu")
    assert (a.query.dtype, a.key_cache.dtype, a.value_cache.dtype) == (dtype, dtype, dtype)


@pytest.mark.parametrize("name,dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e4m3fnuz", torch.float8_e4m3fnuz)])
def test_precompute_inputs_take_an_fp8_cache_by_name(name, dtype):
    p = precompute_inputs(SHAPE, num_tokens=4, dtype="bf16", cache_dtype=name, device="cpu")
    assert p.states.dtype == p.weights.kv_weight.dtype == torch.bfloat16
    assert {c.dtype for c in p.key_caches + p.value_caches} == {dtype}
    assert p.k_scales is not None  # an fp8 cache gets its scales, as with the torch dtype


def test_an_unknown_name_is_refused_listing_the_names_accepted():
    with pytest.raises(ValueError, match="cache_dtype: expected a torch.dtype or one of fp32, fp16, bf16, fp8") as e:
        attention_inputs(SHAPE, batch=1, context_len=8, dtype="bf16", cache_dtype="int4", device="cpu")
    assert all(name in str(e.value) for name in DTYPE_NAMES)
    with pytest.raises(TypeError, match="dtype: expected a torch.dtype"):
        precompute_inputs(SHAPE, num_tokens=4, dtype=16, cache_dtype="bf16", device="cpu")
