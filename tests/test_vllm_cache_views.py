"""vLLM's per-backend KV caches read and written by dflash_rocm through the plugin's views.

Each cache is built exactly as vLLM 0.33 allocates and binds it (``vllm033_layouts``:
``v1/kv_cache_interface.py`` strides, each impl's split), the query tokens' K/V are
written with that backend's own writer (re-implemented from vLLM 0.33's source, cited
there), and then: the views read back what vLLM wrote, draft attention over the views
equals the reference over plain copies, and the precompute writes the bytes vLLM's
writer would. Impl stand-ins carry vLLM's class names (and its subclass relations).
Each check runs for the reference, the portable Triton kernels and the ROCm backend
(simulated gfx942 and gfx1201, on the layouts vLLM binds on AMD), through the interpreter.
"""

import contextlib
from types import SimpleNamespace as NS

import pytest
import torch

import dflash_rocm
import vllm033_layouts as v033
from checks import rel_err, tolerance
from dflash_rocm.paged import logical, read_rows
from dflash_rocm.platform import simulate_platform
from dflash_rocm.vllm_plugin.cache_views import BACKENDS, backend_of, kv_cache_views
from strategies import make_generator, make_weights
from support import needs_interpreter

NB, BS, HK, D = 6, 16, 2, 32

# vLLM's class tree where it matters: unified and segmented subclass ROCM_ATTN's impl.
RocmAttentionImpl = type("RocmAttentionImpl", (), {})
IMPLS = {
    "RocmAttentionImpl": RocmAttentionImpl,
    "RocmSegmentedAttentionImpl": type("RocmSegmentedAttentionImpl", (RocmAttentionImpl,), {}),
    "RocmAiterUnifiedAttentionImpl": type("RocmAiterUnifiedAttentionImpl", (RocmAttentionImpl,), {}),
    **{name: type(name, (), {}) for name in ("AiterFlashAttentionImpl", "TritonAttentionImpl", "FlashAttentionImpl",
                                              "FlexAttentionImpl", "CPUAttentionBackendImpl", "FlashInferImpl")},
}

# (case id, impl class, vLLM 0.33 layout, bound-tensor allocator, writer)
CASES = [
    ("rocm_attn-LHBNC", "RocmAttentionImpl", "LHBNC", "slot", "rocm_attn"),
    ("rocm_attn-LBHNC", "RocmAttentionImpl", "LBHNC", "slot", "rocm_attn"),
    ("rocm_attn-interleaved_v", "RocmAttentionImpl", "LHBNC", "slot", "rocm_attn_interleaved"),
    ("segmented-LHBNC", "RocmSegmentedAttentionImpl", "LHBNC", "slot", "flash_segmented"),
    ("unified-LBHNC", "RocmAiterUnifiedAttentionImpl", "LBHNC", "flash", "flash"),
    ("aiter_fa-LBHNC", "AiterFlashAttentionImpl", "LBHNC", "flash", "flash"),
    ("triton-LBNHC", "TritonAttentionImpl", "LBNHC", "flash", "flash"),
    ("flash_attn-BLHNC", "FlashAttentionImpl", "BLHNC", "flash", "flash"),
    ("cpu-LBHNC", "CPUAttentionBackendImpl", "LBHNC", "flash", "cpu"),
]


# Who reads the views: (backend, simulated architecture or None).
READERS = [("reference", None), ("triton", None), ("rocm", "gfx942"), ("rocm", "gfx1201")]
# Impls vLLM 0.33 binds on AMD (platforms/rocm.py:531-569), the only ones the ROCm backend meets.
AMD_IMPLS = {"RocmAttentionImpl", "RocmSegmentedAttentionImpl", "RocmAiterUnifiedAttentionImpl",
             "AiterFlashAttentionImpl", "TritonAttentionImpl"}
# current_platform.fp8_dtype(): e4m3fnuz on gfx94x, e4m3fn elsewhere (platforms/rocm.py:1259-1268).
FP8_OF = {"gfx942": torch.float8_e4m3fnuz}


def with_readers(cases, ids):
    """``cases`` x :data:`READERS` (the ROCm backend on AMD impls only), as pytest params."""
    params = []
    for backend, arch in READERS:
        marks = [] if backend == "reference" else [needs_interpreter]
        for case, name in zip(cases, ids):
            if arch is None or case[0][1] in AMD_IMPLS:
                params.append(pytest.param(backend, arch, *case, marks=marks,
                                           id=f"{name}-{backend}{'-' + arch if arch else ''}"))
    return params


def on(arch):
    """The simulated architecture's platform (none: the machine's own)."""
    return simulate_platform(arch) if arch else contextlib.nullcontext()


def make_impl(impl_name, cache_dtype, fp8=torch.float8_e4m3fn, **attrs):
    impl = IMPLS[impl_name]()
    impl.num_kv_heads, impl.head_size, impl.kv_cache_dtype = HK, D, cache_dtype
    impl.fp8_dtype = fp8
    impl.__dict__.update(attrs)
    return impl


def bound_cache(kind, layout, dtype, block_size=BS):
    if kind == "slot":
        return v033.alloc_kv_slot_style(NB, block_size, HK, D, dtype, layout, num_layers=2)[1]
    return v033.alloc_flash_style(NB, block_size, HK, D, dtype, layout, num_layers=2)[1]


def vllm_write(writer, kv, key, value, slots, cache_dtype, scale=1.0, fp8=torch.float8_e4m3fn):
    if writer in ("rocm_attn", "rocm_attn_interleaved"):
        v033.write_rocm_attn(key, value, kv, slots, cache_dtype, scale, scale,
                             interleaved_v=writer == "rocm_attn_interleaved", platform_fp8=fp8)
    elif writer == "cpu":
        v033.write_cpu_attn(key, value, kv, slots, cache_dtype, scale, scale)
    else:
        kc, vc = (v033.split_segmented(kv, HK, D) if writer == "flash_segmented" else v033.split_flash_style(kv, D))
        v033.write_flash_style(key, value, kc, vc, slots, cache_dtype, scale, scale, platform_fp8=fp8)


def vllm_logical(writer, kv, cache_dtype, fp8=torch.float8_e4m3fn):
    backend = {"rocm_attn": "ROCM_ATTN", "rocm_attn_interleaved": "ROCM_ATTN", "flash_segmented":
               "ROCM_SEGMENTED_ATTN", "cpu": "CPU_ATTN"}.get(writer, "FLASH_ATTN")
    return v033.logical_kv(backend, kv, HK, D, cache_dtype, interleaved_v=writer == "rocm_attn_interleaved",
                           platform_fp8=fp8)


def fp8_step(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """The spacing of the e4m3 grid at ``|x|`` (3 mantissa bits; subnormal spacing below
    the smallest normal, 2**-6 for e4m3fn and 2**-7 for e4m3fnuz)."""
    min_exp = -7 if fp8 == torch.float8_e4m3fnuz else -6
    exp = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** min_exp))).clamp_min(min_exp)
    return torch.exp2(exp - 3)


def impl_attrs(writer):
    return {"_use_interleaved_v_cache": writer == "rocm_attn_interleaved"}


def layer_for(writer):
    return NS(isa="vec", _k_scale=torch.ones(1), _v_scale=torch.ones(1))


# vLLM's CPU fp8 pages need AVX-512/AMX hosts (their layout is bf16's): not drawn here.
DTYPE_CASES = [(c, dtype) for c in CASES for dtype in ("auto", "fp8") if not (c[4] == "cpu" and dtype == "fp8")]


@pytest.mark.parametrize("backend,arch,case,cache_dtype",
                         with_readers(DTYPE_CASES, [f"{c[0]}-{d}" for c, d in DTYPE_CASES]))
def test_views_read_what_vllms_writer_wrote_and_attention_matches(backend, arch, case, cache_dtype):
    _, impl_name, layout, kind, writer = case
    fp8 = FP8_OF.get(arch, torch.float8_e4m3fn)
    block_size = 32 if writer == "cpu" else BS  # CPU_ATTN pages are multiples of 32 rows
    g = make_generator(7, "cpu")
    kv = bound_cache(kind, layout, torch.uint8 if cache_dtype == "fp8" else torch.bfloat16, block_size)
    seq_lens = [37, 21]
    total = sum(seq_lens)
    key = torch.randn(total, HK, D, generator=g).to(torch.bfloat16)
    value = torch.randn(total, HK, D, generator=g).to(torch.bfloat16)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(NB, generator=g)[:sum(blocks_per_seq)]
    table = torch.zeros(2, max(blocks_per_seq), dtype=torch.int32)
    table[0, :blocks_per_seq[0]] = perm[:blocks_per_seq[0]]
    table[1, :blocks_per_seq[1]] = perm[blocks_per_seq[0]:]
    slots = torch.cat([table[b, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
                       for b, n in enumerate(seq_lens)])
    vllm_write(writer, kv, key, value, slots, cache_dtype, fp8=fp8)  # context and query tokens alike

    impl = make_impl(impl_name, cache_dtype, fp8, **impl_attrs(writer))
    assert backend_of(impl).impl == impl_name  # the most derived class wins
    k_view, v_view = kv_cache_views(impl, layer_for(writer), kv)
    k_want, v_want = vllm_logical(writer, kv, cache_dtype, fp8)
    assert torch.equal(logical(k_view).float(), k_want.float()) and torch.equal(logical(v_view).float(), v_want.float())
    blocks, rows = slots // block_size, slots % block_size
    assert torch.equal(read_rows(k_view, blocks, rows).float(), k_want[blocks, rows].float())

    q_lens = [16, 5]
    q = torch.randn(sum(q_lens), 2 * HK, D, generator=g).to(torch.bfloat16)
    qsl = torch.tensor([0, 16, 21], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    with on(arch):
        out = dflash_rocm.draft_attention(q, k_view, v_view, table, qsl, lens, backend=backend)
    want = dflash_rocm.draft_attention(q, k_want, v_want, table, qsl, lens, backend="reference")
    assert rel_err(out, want) < (1e-6 if backend == "reference" else tolerance(q.dtype, k_want.dtype))


@pytest.mark.parametrize("backend,arch,case,cache_dtype",
                         with_readers(DTYPE_CASES, [f"{c[0]}-{d}" for c, d in DTYPE_CASES]))
def test_the_precompute_writes_the_bytes_vllms_writer_writes(backend, arch, case, cache_dtype):
    """vLLM's writer given the K/V the call returns stores the bytes the call stored: exactly
    for bf16; for fp8 within one fp8 step (the kernels quantise the float32 result, vLLM
    the bf16 one it is handed)."""
    _, impl_name, layout, kind, writer = case
    fp8 = FP8_OF.get(arch, torch.float8_e4m3fn)
    spec_dtype = torch.uint8 if cache_dtype == "fp8" else torch.bfloat16
    scale = 0.5 if cache_dtype == "fp8" else 1.0
    block_size = 32 if writer == "cpu" else BS
    g = make_generator(8, "cpu")
    w = make_weights(g, "cpu", L=1, Hk=HK, D=D, H=24, R=D, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.bfloat16, max_position=128)
    states, positions = torch.randn(9, 24, generator=g).to(torch.bfloat16), torch.arange(9)
    slots = torch.tensor([3, 17, -1, 40, 41, 64, 5, 90, 33])
    ours = bound_cache(kind, layout, spec_dtype, block_size)
    k_view, v_view = kv_cache_views(make_impl(impl_name, cache_dtype, fp8, **impl_attrs(writer)), layer_for(writer),
                                    ours)
    scales = dict(k_scales=[scale], v_scales=[scale]) if cache_dtype == "fp8" else {}
    with on(arch):
        k, v = dflash_rocm.precompute_and_store_context_kv(states, positions, w, [k_view], [v_view], slots,
                                                           return_kv=True, backend=backend, **scales)
    theirs = bound_cache(kind, layout, spec_dtype, block_size)
    vllm_write(writer, theirs, k[0], v[0], slots, cache_dtype, scale, fp8)
    if cache_dtype != "fp8":
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
        return
    assert (ours.view(torch.uint8) != theirs.view(torch.uint8)).sum() <= 2 * HK * D * int((slots >= 0).sum())
    theirs_kv = vllm_logical(writer, theirs, cache_dtype, fp8)
    for mine, vllms in zip(vllm_logical(writer, ours, cache_dtype, fp8), theirs_kv):
        mine, vllms = mine.float(), vllms.float()
        assert ((mine - vllms).abs() <= fp8_step(torch.maximum(mine.abs(), vllms.abs()), fp8)).all()
        assert (mine != 0).sum() >= 0.9 * HK * D * int((slots >= 0).sum())  # the slots were written


def test_layouts_dflash_rocm_cannot_read_are_reasons_not_guesses():
    kv = bound_cache("flash", "LBHNC", torch.bfloat16)
    assert "block table" in kv_cache_views(make_impl("FlashInferImpl", "auto"), object(), kv)
    assert "packs its pages" in kv_cache_views(make_impl("CPUAttentionBackendImpl", "auto"), NS(isa="amx"), kv)
    assert "e5m2" in kv_cache_views(make_impl("TritonAttentionImpl", "fp8_e5m2"), object(), kv)
    per_token = make_impl("TritonAttentionImpl", "auto", _is_per_token_head_quant=True)
    assert "per-token-head" in kv_cache_views(per_token, object(), kv)
    assert "does not know" in kv_cache_views(NS(num_kv_heads=HK, head_size=D), object(), kv)


def test_every_known_backend_is_documented():
    names = {b.name for b in BACKENDS}
    assert {"ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN", "TRITON_ATTN", "FLASH_ATTN", "FLASHINFER",
            "ROCM_SEGMENTED_ATTN", "CPU_ATTN"} <= names
    from pathlib import Path
    docs = (Path(__file__).resolve().parent.parent / "docs" / "vllm.md").read_text()
    assert all(f"`{name}`" in docs for name in names), "docs/vllm.md's vLLM backend table lists every backend"


def test_draft_forward_maps_flash_metadata_onto_the_spec():
    """The draft impl's forward on a FlashAttention-layout cache and FA-style metadata
    equals the reference on the same K/V; a causal tensor goes back to vLLM's forward."""
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
    assert rel_err(output[:10].view(10, 4, 16), ref) < 2e-3
    assert torch.isnan(output[10:]).all() and base_calls == []
    metadata.causal = torch.tensor([True, False])
    impl.forward(layer, q.reshape(10, -1), None, None, kv, metadata, output)
    assert len(base_calls) == 1


def test_vllm_034_puts_triton_attn_first_on_rdna3_and_rdna4():
    """What ``dflash-rocm info`` lists as vLLM's attention order: 0.34 swaps ROCM_ATTN and
    TRITON_ATTN on gfx1100 and gfx1201 (platforms/rocm.py), elsewhere on AMD ROCM_ATTN leads."""
    from dflash_rocm.vllm_plugin.cache_views import vllm_order

    def names(vendor, arch):
        return [b.name for b in vllm_order(vendor, arch)]

    assert names("rocm", "gfx942") == ["ROCM_ATTN", "ROCM_AITER_FA", "TRITON_ATTN"]
    for arch in ("gfx1100", "gfx1201"):
        assert names("rocm", arch) == ["TRITON_ATTN", "ROCM_AITER_FA", "ROCM_ATTN"]
    assert names("cuda", "sm_90")[0] == "FLASH_ATTN" and names("cpu", None) == ["CPU_ATTN"]
