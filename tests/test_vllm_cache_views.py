"""vLLM's per-backend KV cache layouts as [blocks, bs, Hk, D] views, checked element by
element against each layout's definition (impl stand-ins carry vLLM's class names)."""

import pytest
import torch

from dflash_rocm.vllm_plugin.cache_views import kv_cache_views

NB, BS, HK, D = 3, 4, 2, 8


def impl_named(name, **attrs):
    cls = type(name, (), {})
    impl = cls()
    impl.num_kv_heads, impl.head_size, impl.kv_cache_dtype = HK, D, "auto"
    impl.__dict__.update(attrs)
    return impl


def expected_key(b, r, h, d):
    return 1000 * b + 100 * r + 10 * h + d


def test_logical_bhn2d_layouts_of_flash_triton_and_aiter():
    """FlashAttention/Triton/aiter FA: logical [blocks, Hk, bs, 2D], K then V in the last dim."""
    kv = torch.zeros(NB, HK, BS, 2 * D)
    for b in range(NB):
        for h in range(HK):
            for r in range(BS):
                for d in range(D):
                    kv[b, h, r, d] = expected_key(b, r, h, d)
                    kv[b, h, r, D + d] = -expected_key(b, r, h, d)
    for name in ("FlashAttentionImpl", "TritonAttentionImpl", "AiterFlashAttentionImpl"):
        k, v = kv_cache_views(impl_named(name), object(), kv)
        assert k.shape == (NB, BS, HK, D) and k.data_ptr() == kv.data_ptr()
        assert k[2, 3, 1, 5] == expected_key(2, 3, 1, 5) and v[1, 2, 0, 7] == -expected_key(1, 2, 0, 7)


def test_rocm_segmented_layout():
    """ROCm segmented: [blocks, 2, bs, Hk*D]."""
    kv = torch.arange(NB * 2 * BS * HK * D, dtype=torch.float32).view(NB, 2, BS, HK * D)
    k, v = kv_cache_views(impl_named("RocmSegmentedAttentionImpl"), object(), kv)
    assert k[1, 2, 1, 3] == kv[1, 0, 2, 1 * D + 3] and v[2, 0, 0, 6] == kv[2, 1, 0, 6]


def test_cpu_layout_stores_keys_transposed_per_page():
    """CPU_ATTN (ISA vec/vec16): per (block, head) page, K^T [D, bs] then V [bs, D]."""
    kv = torch.zeros(NB, HK, BS, 2 * D)
    pages = kv.view(NB, HK, 2 * BS * D)
    for b in range(NB):
        for h in range(HK):
            for r in range(BS):
                for d in range(D):
                    pages[b, h, d * BS + r] = expected_key(b, r, h, d)
                    pages[b, h, BS * D + r * D + d] = -expected_key(b, r, h, d)
    layer = type("Layer", (), {"isa": "vec"})()
    k, v = kv_cache_views(impl_named("CPUAttentionBackendImpl"), layer, kv)
    for b, r, h, d in ((0, 0, 0, 0), (2, 3, 1, 7), (1, 1, 0, 4)):
        assert k[b, r, h, d] == expected_key(b, r, h, d) and v[b, r, h, d] == -expected_key(b, r, h, d)
    packed = type("Layer", (), {"isa": "amx"})()
    assert "packs its pages" in kv_cache_views(impl_named("CPUAttentionBackendImpl"), packed, kv)


def test_fp8_caches_are_viewed_in_the_platform_format():
    kv = torch.zeros(NB, HK, BS, 2 * D, dtype=torch.uint8)
    impl = impl_named("FlashAttentionImpl", kv_cache_dtype="fp8", fp8_dtype=torch.float8_e4m3fnuz)
    k, v = kv_cache_views(impl, object(), kv)
    assert k.dtype == v.dtype == torch.float8_e4m3fnuz and k.data_ptr() == kv.data_ptr()


@pytest.mark.parametrize("name", ["RocmAttentionImpl", "FlashInferImpl"])
def test_unknown_layouts_are_reasons_not_guesses(name):
    reason = kv_cache_views(impl_named(name), object(), torch.zeros(NB, HK, BS, 2 * D))
    assert isinstance(reason, str) and name in reason


def test_per_token_head_quantised_caches_are_refused():
    impl = impl_named("TritonAttentionImpl", _is_per_token_head_quant=True)
    assert "per-token-head" in kv_cache_views(impl, object(), torch.zeros(NB, HK, BS, 2 * D))
