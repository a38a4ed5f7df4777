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


def test_draft_forward_maps_flash_metadata_onto_the_spec():
    """The draft impl's forward on a FlashAttention-layout cache and FA-style metadata
    equals the reference on the same K/V; a causal tensor goes back to vLLM's forward."""
    from types import SimpleNamespace as NS

    import dflash_rocm
    from dflash_rocm.vllm_plugin.attention import draft_impl_class
    from test_triton_backend import paged

    q, kc, vc, table, qsl, lens = paged([23, 11], [5, 5], Hk=2, G=2, D=16, block_size=4)
    sinks = torch.linspace(-1, 1, 4)
    base_calls = []

    class FlashAttentionImpl:
        def __init__(self):
            self.num_heads, self.num_kv_heads, self.head_size = 4, 2, 16
            self.scale, self.sinks, self.kv_cache_dtype = 0.3, sinks, "auto"

        def forward(self, *args, **kwargs):
            base_calls.append(args)
            return args[6]

    impl = FlashAttentionImpl()
    impl.__class__ = draft_impl_class(FlashAttentionImpl)
    impl.dflash_sliding_window, impl.dflash_causal = 6, False
    kv = torch.cat([kc, vc], dim=-1).transpose(1, 2).contiguous()  # logical [blocks, Hk, bs, 2D]
    layer = NS(_k_scale=torch.ones(1), _v_scale=torch.ones(1))
    metadata = NS(num_actual_tokens=10, query_start_loc=qsl, seq_lens=lens, block_table=table, max_query_len=5,
                  max_seq_len=23, causal=True)
    output = torch.full((12, 4 * 16), float("nan"))
    impl.forward(layer, q.reshape(10, -1), None, None, kv, metadata, output)
    ref = dflash_rocm.draft_attention(q, kc, vc, table, qsl, lens, scale=0.3, causal=True, sliding_window=6,
                                      sinks=sinks, backend="reference")
    assert dflash_rocm.contract.relative_error(output[:10].view(10, 4, 16), ref) < 2e-3
    assert torch.isnan(output[10:]).all() and base_calls == []
    metadata.causal = torch.tensor([True, False])
    impl.forward(layer, q.reshape(10, -1), None, None, kv, metadata, output)
    assert len(base_calls) == 1
