"""The Triton backend against the reference (through the interpreter on CPU)."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import dflash_rocm
from dflash_rocm.planning import on_platform, record_for
from checks import check_attention, check_precompute
from dflash_rocm.paged import PackedCache, read_rows
from strategies import (CPU_SIZES, PACKINGS, WEIGHT_FORMATS, attention_cases, attention_launch_configs, make_generator,
                        make_weights, pack_caches, precompute_cases, precompute_launch_configs)
from support import needs_interpreter

pytestmark = needs_interpreter


@given(attention_cases(CPU_SIZES, packings=PACKINGS))
def test_attention_matches_reference(case):
    check_attention(case, "triton")


@given(st.data())
def test_attention_matches_reference_for_every_launch_config(data):
    from dflash_rocm.backends.triton.attention import run_draft_attention

    case = data.draw(attention_cases(CPU_SIZES, packings=PACKINGS))
    G = case.query.shape[1] // case.args[1].shape[2]
    config = data.draw(attention_launch_configs(G))
    check_attention(case, "triton", run=lambda call: run_draft_attention(call, config))


@given(precompute_cases(CPU_SIZES, packings=PACKINGS))
def test_precompute_matches_reference(case):
    check_precompute(case, "triton")


@given(st.data())
def test_precompute_matches_reference_for_every_launch_config(data):
    from dflash_rocm.backends.triton.precompute import run_precompute

    case = data.draw(precompute_cases(CPU_SIZES, packings=PACKINGS))
    config = data.draw(precompute_launch_configs())
    check_precompute(case, "triton", run=lambda call: run_precompute(call, config))


@given(st.data())
def test_precompute_with_fp8_weights_matches_reference_for_every_launch_config(data):
    """fp8 rows (e4m3fn, e4m3fnuz; per-tensor and per-channel scales; [H] and per-layer
    [L, H] norms) read as they are, under every launch config (split, both heads)."""
    from dflash_rocm.backends.triton.precompute import run_precompute

    case = data.draw(precompute_cases(CPU_SIZES, packings=PACKINGS, weight_formats=WEIGHT_FORMATS))
    config = data.draw(precompute_launch_configs())
    check_precompute(case, "triton", run=lambda call: run_precompute(call, config))


def test_fp8_rows_stay_fp8_in_the_fused_layout():
    """The fused layout keeps fp8 rows (half the bytes of bf16 rows), permuted as float rows
    are, with their scales as the row scales and the norm weight beside them."""
    from dflash_rocm.backends.triton.precompute import fused_weights

    g = make_generator(6, "cpu")
    dense = make_weights(g, "cpu", L=2, Hk=2, D=16, H=32, R=16, is_neox=True, bias=False, v_scale=None,
                         dtype=torch.float32, per_layer_norm=True)
    fp8 = dataclasses.replace(dense, kv_weight=dense.kv_weight.to(torch.float8_e4m3fn),
                              kv_weight_scale=torch.rand(dense.kv_weight.shape[0], generator=g) + 0.5)
    ones = dataclasses.replace(dense, kv_weight=fp8.kv_weight.float(), hidden_norm_weight=torch.ones(2, 32))
    got, float_rows = fused_weights(fp8), fused_weights(ones)
    assert got.weight.dtype == torch.float8_e4m3fn and got.weight.element_size() == 1
    assert torch.equal(got.weight.float(), float_rows.weight)  # the same permutation
    permuted_scales = fused_weights(dataclasses.replace(ones, kv_weight=fp8.kv_weight_scale[:, None].expand(-1, 32)))
    assert torch.equal(got.row_scale, permuted_scales.weight[:, 0])
    norm = got.scale_table[:-got.row_scale.numel()].view(2, 32)  # the norm weight, right before the row scales
    assert got.row_scale.data_ptr() == got.scale_table.data_ptr() + norm.numel() * 4
    assert torch.equal(norm, dense.hidden_norm_weight)


@given(precompute_cases(CPU_SIZES, packings=PACKINGS))
def test_precompute_with_a_kv_heads_k_and_v_in_one_program_matches_reference(case):
    """``heads=2``: each program computes one KV head's K and V tiles from the same loads of
    the states; every layer, cache layout and per-layer mapping as with one head row."""
    from dflash_rocm.backends.triton.launch_config import PrecomputeLaunchConfig
    from dflash_rocm.backends.triton.precompute import run_precompute

    config = PrecomputeLaunchConfig(block_t=16, block_k=16, heads=2, num_xcds=3)
    check_precompute(case, "triton", run=lambda call: run_precompute(call, config))


def test_the_portable_table_pairs_k_and_v_on_hopper_and_blackwell_from_two_token_tiles():
    """On sm_90/sm_100 (the L2 bounds the precompute there) a KV head's K and V share a
    program once there are two token tiles of 128; a single tile keeps one head row a program
    (its 40 programs would leave SMs idle), and so do sm_80/sm_89 (the two accumulators
    spill there) and other vendors."""
    from dflash_rocm.backends.triton.launch_config import default_precompute_config
    from dflash_rocm.platform import platform_for_arch

    def heads(arch, tokens, head_dim=128):
        return default_precompute_config(platform_for_arch(arch), num_tokens=tokens, hidden=4096,
                                         num_heads_total=80, head_dim=head_dim).heads

    assert heads("sm_90", 256) == 2 and heads("sm_90", 4096) == 2
    assert heads("sm_90", 128) == 1 and heads("sm_90", 32) == 1 and heads("sm_90", 4096, head_dim=256) == 1
    assert heads("sm_100", 256) == 2 and heads("sm_80", 4096) == 1 and heads("sm_89", 4096) == 1
    assert heads("gfx942", 4096) == 1 and heads("gfx1201", 4096) == 1


def test_precompute_heads_are_one_or_two_and_two_only_unsplit():
    from dflash_rocm.backends.triton.launch_config import PrecomputeLaunchConfig

    with pytest.raises(ValueError, match="heads: expected 1 or 2"):
        PrecomputeLaunchConfig(heads=4)
    with pytest.raises(ValueError, match="only without a split"):
        PrecomputeLaunchConfig(heads=2, split_k=2)


def paged(seq_lens, q_lens, Hk, G, D, block_size, dtype=torch.float32, seed=0):
    g = make_generator(seed, "cpu")
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[used:used + n]
        used += n
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), Hk * G, D, generator=g).to(dtype)
    kc = torch.randn(num_blocks, block_size, Hk, D, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, Hk, D, generator=g).to(dtype)
    return q, kc, vc, table, qsl, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_head_dims(head_dim, causal):
    args = paged([37, 20], [16, 5], Hk=2, G=4, D=head_dim, block_size=16, dtype=torch.bfloat16)
    ref = dflash_rocm.draft_attention(*args, causal=causal, backend="reference")
    out = dflash_rocm.draft_attention(*args, causal=causal, backend="triton")
    assert dflash_rocm.contract.relative_error(out, ref) < 2e-2


@pytest.mark.parametrize("G", [1, 4, 16])
def test_query_longer_than_one_tile_is_not_truncated(G):
    """Query capacity is a tile setting: a 40-token query spans several tiles."""
    from dflash_rocm.backends.triton.attention import run_draft_attention
    from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig
    from dflash_rocm.ops.attention import attention_call

    args = paged([34, 21], [18, 21], Hk=1, G=G, D=32, block_size=8)
    config = AttentionLaunchConfig(block_m=16 if G < 16 else 32, block_n=16, num_segments=2)
    for causal in (False, True):
        ref = dflash_rocm.draft_attention(*args, causal=causal, sliding_window=9, backend="reference")
        call = attention_call(*args, causal=causal, sliding_window=9)
        run_draft_attention(call, config)
        assert dflash_rocm.contract.relative_error(call.out, ref) < 2e-3


def test_attention_reads_vllm_cache_layouts_through_views():
    """FlashAttention's [2, blocks, bs, Hk, D] and ROCm's [blocks, 2, bs, Hk*D] caches are
    strided [blocks, bs, Hk, D] views; a strided query and out work as well."""
    q, kc, vc, table, qsl, lens = paged([30, 9], [6, 3], Hk=2, G=2, D=32, block_size=4)
    flash = torch.stack([kc, vc])
    rocm = torch.stack([kc.flatten(2), vc.flatten(2)], dim=1)
    rocm_k = rocm[:, 0].view(kc.shape[0], 4, 2, 32)
    rocm_v = rocm[:, 1].view(kc.shape[0], 4, 2, 32)
    wide_q = torch.zeros(q.shape[0], q.shape[1], 64)
    wide_q[..., ::2] = q
    strided_q = wide_q[..., ::2]
    ref = dflash_rocm.draft_attention(q, kc, vc, table, qsl, lens, backend="reference")
    for k_view, v_view in ((flash[0], flash[1]), (rocm_k, rocm_v)):
        out_store = torch.full((q.shape[0], 64, q.shape[1]), float("nan"))
        out = out_store[:, :32].transpose(1, 2)  # non-contiguous out
        dflash_rocm.draft_attention(strided_q, k_view, v_view, table, qsl, lens, out=out, backend="triton")
        assert dflash_rocm.contract.relative_error(out, ref) < 2e-3
        assert torch.isnan(out_store[:, 32:]).all(), "wrote outside out"


def off_by_one_element(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values and strides, one element further into a fresh buffer: nothing in it
    starts 16-byte aligned any more."""
    buf = torch.empty(t.untyped_storage().nbytes() // t.element_size() + 1, dtype=t.dtype)
    moved = buf.as_strided(t.shape, t.stride(), t.storage_offset() + 1)
    moved.copy_(t)
    return moved


def unaligned(cache):
    return PackedCache(off_by_one_element(cache.view)) if isinstance(cache, PackedCache) else off_by_one_element(cache)


@pytest.mark.parametrize("packing", ["rocm_attn", "rocm_attn_interleaved_v"])
def test_packed_pages_off_16_byte_alignment_are_read_and_written_element_by_element(packing):
    """Packed pages the kernels cannot prove aligned (strides in elements, scalar accesses)
    give the same results as aligned ones (strides in 16-byte units, vector accesses)."""
    from dflash_rocm.backends.triton.attention import stride_unit
    from dflash_rocm.backends.triton.precompute import aligned_runs

    q, kc, vc, table, qsl, lens = paged([37, 20], [16, 5], Hk=2, G=2, D=32, block_size=16, dtype=torch.float16)
    ref = dflash_rocm.draft_attention(q, kc, vc, table, qsl, lens, backend="reference")
    k, v = (unaligned(c) for c in pack_caches(kc, vc, packing))
    assert stride_unit(k) == stride_unit(v) == 1 and stride_unit(pack_caches(kc, vc, packing)[0]) == 8
    out = dflash_rocm.draft_attention(q, k, v, table, qsl, lens, backend="triton")
    assert dflash_rocm.contract.relative_error(out, ref) < 2e-3

    g = make_generator(5, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=2, D=32, H=40, R=32, is_neox=False, bias=False, v_scale=None,
                     dtype=torch.float16)
    states, positions = torch.randn(7, 40, generator=g).half(), torch.arange(7)
    slots = torch.tensor([3, 9, -1, 40, 0, 17, 63])
    empty = torch.zeros(4, 16, 2, 32, dtype=torch.float16)
    caches = [tuple(unaligned(c) for c in pack_caches(empty, empty.clone(), packing)) for _ in range(2)]
    assert not any(aligned_runs(c) for pair in caches for c in pair)
    rk, rv = dflash_rocm.precompute_and_store_context_kv(states, positions, w, [k for k, _ in caches],
                                                         [v for _, v in caches], slots, return_kv=True,
                                                         backend="triton")
    keep = slots >= 0
    for layer, (k, v) in enumerate(caches):
        blocks, rows = slots[keep] // 16, slots[keep] % 16
        assert torch.equal(read_rows(k, blocks, rows), rk[layer][keep])
        assert torch.equal(read_rows(v, blocks, rows), rv[layer][keep])


def test_precompute_many_tokens_and_odd_hidden_size():
    g = make_generator(3, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=1, D=32, H=72, R=16, is_neox=True, bias=True, v_scale=0.5,
                     dtype=torch.bfloat16)
    N = 2000
    states = torch.randn(N, 72, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (N,), generator=g)
    ref_k, ref_v = dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None,
                                                               return_kv=True, backend="reference")
    k, v = dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None,
                                                       return_kv=True, backend="triton")
    assert dflash_rocm.contract.relative_error(k, ref_k) < 2e-2 and dflash_rocm.contract.relative_error(v, ref_v) < 2e-2


class _CountTritonLaunches:
    """Counts every Triton kernel launch (compiled or interpreted), whoever makes it."""

    def __init__(self, monkeypatch):
        import triton.runtime.interpreter as interpreter
        import triton.runtime.jit as jit
        self.count = 0
        for cls in (jit.JITFunction, interpreter.InterpretedFunction):
            original = cls.run

            def counted(fn_self, *args, _original=original, **kwargs):
                self.count += 1
                return _original(fn_self, *args, **kwargs)
            monkeypatch.setattr(cls, "run", counted)


class _AtenOps(TorchDispatchMode):
    """The torch ops run, by name; a stack of integer tensors (per-layer slot mappings
    gathered for the kernel) is index plumbing, recorded as ``stack_index``."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "stack" and not any(t.is_floating_point() for t in args[0]):
            name = "stack_index"
        self.ops.add(name)
        return func(*args, **(kwargs or {}))


# The unfused sequence's work: none of it may run outside the fused kernels.
_COMPUTE_OPS = {"mm", "addmm", "bmm", "matmul", "linear", "mul", "add", "div", "rsqrt", "pow", "mean", "sum",
                "cat", "stack", "index_put", "index", "cos", "sin", "neg", "permute", "clone"}


@pytest.mark.parametrize("block_t,split_k,whole_tiles,heads", [(16, 1, 0, 1), (32, 3, 0, 1), (16, 3, 0, 1),
                                                              (16, 3, 7, 1), (16, 1, 0, 2)])
def test_precompute_is_one_launch_for_all_layers(monkeypatch, block_t, split_k, whole_tiles, heads):
    """All layers in one launch, a split hidden size summed by its last part (N = 20 is
    two 16-token tiles: all split, or the first seven whole and the rest split), or a KV
    head's K and V in one program (half the programs)."""
    from dflash_rocm.backends.triton.launch_config import PrecomputeLaunchConfig
    from dflash_rocm.backends.triton.precompute import fused_weights, run_precompute
    from dflash_rocm.ops.precompute import precompute_call

    g = make_generator(4, "cpu")
    L = 5
    w = make_weights(g, "cpu", L=L, Hk=2, D=16, H=48, R=16, is_neox=True, bias=True, v_scale=2.0,
                     dtype=torch.float16)
    N = 20
    caches = [torch.zeros(4, 8, 2, 16, dtype=torch.float8_e4m3fn) for _ in range(2 * L)]
    slots = [torch.randperm(32, generator=g)[:N] for _ in range(L)]
    slots[2] = None
    call = precompute_call(torch.randn(N, 48, generator=g).half(), torch.arange(N), w, caches[:L], caches[L:],
                           slots, k_scales=torch.full((L,), 0.5), v_scales=torch.full((L,), 2.0), return_kv=True)
    fused_weights(w)  # the one-time weight preparation is not part of a call
    counter = _CountTritonLaunches(monkeypatch)
    with _AtenOps() as aten:
        run_precompute(call, PrecomputeLaunchConfig(block_t=block_t, block_k=16, split_k=split_k,
                                                    whole_tiles=whole_tiles, heads=heads))
    assert counter.count == 1
    if heads == 2:  # two token tiles x (5 layers x 2 KV heads): a program per KV head, not per K or V head
        from dflash_rocm.backends.triton.precompute import plan_precompute
        assert plan_precompute(*record_for("precompute_and_store_context_kv", "triton", call),
                               PrecomputeLaunchConfig(block_t=16, block_k=16, heads=2)).main.grid == (2 * L * 2,)
    assert not (aten.ops & _COMPUTE_OPS), f"unfused torch work in the fused path: {aten.ops & _COMPUTE_OPS}"


def test_attention_is_one_launch_unless_split_and_merged_by_a_second(monkeypatch):
    from dflash_rocm.backends.triton.attention import run_draft_attention
    from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig
    from dflash_rocm.ops.attention import attention_call

    args = paged([40, 17], [16, 16], Hk=2, G=4, D=32, block_size=16)
    ref = dflash_rocm.draft_attention(*args, backend="reference")
    counter = _CountTritonLaunches(monkeypatch)
    for segments, merge, launches in ((1, "last", 1), (4, "last", 1), (4, "tail", 1), (4, "launch", 2)):
        call = attention_call(*args)
        before = counter.count
        run_draft_attention(call, AttentionLaunchConfig(block_m=64, block_n=16, num_segments=segments, merge=merge))
        assert counter.count - before == launches
        assert dflash_rocm.contract.relative_error(call.out, ref) < 1e-3


def test_a_gpu_plan_merges_by_a_second_launch_where_mergers_could_fill_an_xcd(monkeypatch):
    """Merger programs wait on segments: on a GPU whose XCDs would each be filled by them,
    the plan merges by a second launch instead, whatever the configuration asked."""
    from dflash_rocm.backends.triton import attention
    from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig
    from dflash_rocm.ops.attention import AttentionCall, attention_call
    from dflash_rocm.platform import platform_for_arch

    call = attention_call(*paged([600], [16], Hk=2, G=4, D=32, block_size=16))
    config = AttentionLaunchConfig(block_m=64, block_n=16, num_segments=16, merge="tail")
    record, facts = record_for("draft_attention", "triton", call)
    monkeypatch.setattr(AttentionCall, "device", property(lambda self: torch.device("cuda")))
    for units, mergers, second in ((304, 16, False), (16, 0, True)):  # 2 x 16 mergers: 4 per XCD vs 2 CUs per XCD
        plan = attention.plan_attention(on_platform(record, platform_for_arch("gfx942", compute_units=units)),
                                        facts, config)
        assert plan.main.constexprs["MERGERS"] == mergers and (plan.merge is not None) == second
        assert plan.main.grid[2] == 16 + mergers and plan.scratch.counters == (0 if second else 2)


def test_tail_merge_can_be_switched_off(monkeypatch):
    from dflash_rocm.backends.triton import attention
    from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig
    from dflash_rocm.ops.attention import attention_call

    call = attention_call(*paged([600], [16], Hk=2, G=4, D=32, block_size=16))
    config = AttentionLaunchConfig(block_m=64, block_n=16, num_segments=16, merge="tail")
    assert attention.plan_attention(*record_for("draft_attention", "triton", call), config).main.constexprs[
        "MERGERS"] == 16
    monkeypatch.setenv("DFLASH_ROCM_TAIL_MERGE", "off")
    plan = attention.plan_attention(*record_for("draft_attention", "triton", call), config)
    assert plan.main.constexprs["MERGERS"] == 0 and plan.merge is not None


@pytest.mark.parametrize("segments", [3, 4, 8])
def test_a_wave64_last_segment_merge_loads_two_partials_a_trip_and_masks_the_odd_one(segments):
    """On wave64 the last segment's merge loads two segments' partials a trip: an odd count of
    active segments leaves the second lane group of the last trip masked."""
    from dflash_rocm.backends.triton.attention import merge_chunk, run_draft_attention
    from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig
    from dflash_rocm.ops.attention import attention_call

    config = AttentionLaunchConfig(block_m=64, block_n=16, num_segments=segments, num_warps=1, wave_size=64)
    assert merge_chunk(config, 32) == 2 and merge_chunk(dataclasses.replace(config, wave_size=32), 32) == 1
    args = paged([70, 45], [16, 9], Hk=2, G=4, D=32, block_size=16)
    ref = dflash_rocm.draft_attention(*args, backend="reference")
    call = attention_call(*args)
    run_draft_attention(call, config)
    assert dflash_rocm.contract.relative_error(call.out, ref) < 2e-3


def test_split_tile_counters_are_left_zero_for_the_next_launch():
    from dflash_rocm.backends.triton.attention import run_draft_attention
    from dflash_rocm.backends.triton.counters import _KEPT
    from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig
    from dflash_rocm.ops.attention import attention_call

    args = paged([70, 33], [16, 9], Hk=2, G=4, D=32, block_size=16)
    for merge in ("last", "tail"):  # the last merger to finish resets its tile's counter
        run_draft_attention(attention_call(*args), AttentionLaunchConfig(block_m=32, block_n=16, num_segments=4,
                                                                         merge=merge))
        counters = _KEPT[(torch.device("cpu"), None, torch.int32, True)]
        assert counters.numel() >= 4 and not counters.any()


@pytest.mark.parametrize("deterministic", [False, True])
def test_split_parts_add_into_one_sum_unless_torch_asks_for_determinism(deterministic):
    """By default the parts of a split tile add into one float32 sum, which the merging
    part reads and leaves zero for the next launch (a sum left over would add into the
    second run below); under ``torch.use_deterministic_algorithms`` each part keeps its
    own tile and the merge sums them in order."""
    from dflash_rocm.backends.triton.counters import _KEPT
    from dflash_rocm.backends.triton.launch_config import PrecomputeLaunchConfig
    from dflash_rocm.backends.triton.precompute import plan_precompute, run_precompute
    from dflash_rocm.ops.precompute import precompute_call

    g = make_generator(6, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=2, D=16, H=48, R=16, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.float32)
    states = torch.randn(20, 48, generator=g)
    rk, rv = dflash_rocm.precompute_and_store_context_kv(states, torch.arange(20), w, None, None, None,
                                                         return_kv=True, backend="reference")
    call = precompute_call(states, torch.arange(20), w, None, None, None, return_kv=True)
    config = PrecomputeLaunchConfig(block_t=16, block_k=16, split_k=3, whole_tiles=2)  # 8 tiles: 6 split
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        assert plan_precompute(*record_for("precompute_and_store_context_kv", "triton", call),
                               config).atomic_sum is not deterministic
        for _ in range(2):
            k, v = run_precompute(call, config)
            assert max(dflash_rocm.contract.relative_error(k, rk), dflash_rocm.contract.relative_error(v, rv)) < 1e-5
    finally:
        torch.use_deterministic_algorithms(before)
    if not deterministic:
        sums = _KEPT[(torch.device("cpu"), None, torch.float32, True)]
        assert sums.numel() >= 6 * 16 * 17 and not sums.any()


def _fma_rounds_once() -> bool:
    """Whether this Triton's ``tl.fma`` rounds once, as the hardware's does (Triton 3.8's
    interpreter multiplies, rounds, then adds): (1 + 2**-12)**2 - (1 + 2**-11) is 2**-24
    fused and 0 rounded twice."""
    from divide_kernel import fma_kernel

    a = torch.full((16,), 1 + 2 ** -12)
    out = torch.empty(16)
    fma_kernel[(1,)](a, a, torch.full((16,), -(1 + 2 ** -11)), out, BLOCK=16)
    return bool((out == 2 ** -24).all())


def test_division_by_a_shared_divisor_is_rounded_as_a_division():
    """The fp8 epilogue divides by the cache scale with a reciprocal and one FMA correction:
    bitwise the float32 quotient, where the product alone is an ulp off for 10-42 % of the
    values drawn here per divisor but the power of two (40 binades; infinities and NaN too).
    Where ``tl.fma`` rounds twice (Triton 3.8's interpreter, not a GPU) the correction
    itself is rounded, and the quotient is held to one ulp instead."""
    from divide_kernel import divide_kernel

    ulps = 0 if _fma_rounds_once() else 1
    g = make_generator(7, "cpu")
    x = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-20, 20, (4096,), generator=g).float())
    x[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0])
    for divisor in (0.37, 1.9, 3.0, 0.5, 1e-3, 7.3e4):
        d = torch.tensor([divisor], dtype=torch.float32)
        out = torch.empty_like(x)
        divide_kernel[(1,)](x, d, out, BLOCK=4096)
        want = x / d
        apart = (out.view(torch.int32) - want.view(torch.int32))[~want.isnan()].abs().max()
        assert torch.equal(out.isnan(), want.isnan()) and apart <= ulps, (divisor, int(apart))


def test_an_outgrown_counter_buffer_is_kept_alive():
    """A graph captured with a counter buffer keeps using its memory on every replay, so a
    larger launch's new buffer must not free the old one (its memory could then hold some
    other tensor that replays would corrupt)."""
    import gc
    import weakref

    from dflash_rocm.backends.triton import counters

    device = torch.device("cpu")
    small = counters.kept_zeroed(device, 8)
    gone = weakref.ref(small)
    big = counters.kept_zeroed(device, 2 * small.numel())
    assert big.numel() > small.numel() and counters.kept_zeroed(device, 8) is big
    del small
    gc.collect()
    assert gone() is not None and not gone().any()


def test_no_write_outside_slots_even_with_duplicate_free_random_slots():
    """Every byte of every cache outside the mapping stays, for every layer and both caches."""
    g = make_generator(5, "cpu")
    w = make_weights(g, "cpu", L=3, Hk=2, D=16, H=24, R=8, is_neox=False, bias=False, v_scale=None,
                     dtype=torch.float32)
    caches = [torch.randn(3, 4, 2, 16, generator=g) for _ in range(6)]
    before = [c.clone() for c in caches]
    slots = torch.tensor([11, -1, 0, 7, -1])
    dflash_rocm.precompute_and_store_context_kv(torch.randn(5, 24, generator=g), torch.arange(5), w,
                                                caches[:3], caches[3:], slots, backend="triton")
    written = torch.zeros(12, dtype=torch.bool)
    written[[11, 0, 7]] = True
    for c, b in zip(caches, before):
        assert torch.equal(c.view(12, 2, 16)[~written], b.view(12, 2, 16)[~written])
        assert not torch.equal(c.view(12, 2, 16)[written], b.view(12, 2, 16)[written])


def test_layers_with_different_block_sizes_each_use_their_own():
    """The kernel divides slots by the block size all written caches share (a constant);
    where layers' caches differ, by each layer's own from the cache table."""
    from dflash_rocm.backends.triton.precompute import shared_block_size
    from dflash_rocm.ops.precompute import precompute_call

    g = make_generator(9, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=2, D=16, H=24, R=16, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.float32)
    states, positions, slots = torch.randn(5, 24, generator=g), torch.arange(5), torch.tensor([13, 0, -1, 6, 2])
    results = {}
    for backend in ("reference", "triton"):
        caches = [torch.zeros(5, bs, 2, 16) for bs in (4, 3, 4, 3)]  # layer 0 blocks of 4, layer 1 of 3
        dflash_rocm.precompute_and_store_context_kv(states, positions, w, caches[:2], caches[2:], slots,
                                                    backend=backend)
        results[backend] = caches
    for got, want in zip(results["triton"], results["reference"]):
        assert want.abs().sum() > 0 and dflash_rocm.contract.relative_error(got, want) < 2e-3
    assert shared_block_size(precompute_call(states, positions, w, results["triton"][:2], results["triton"][2:],
                                             slots)) == 0
    same = [torch.zeros(5, 4, 2, 16) for _ in range(4)]
    assert shared_block_size(precompute_call(states, positions, w, same[:2], same[2:], slots)) == 4


def test_a_plan_kept_for_one_cache_set_never_writes_another():
    """Plans are kept per call structure; two cache sets of one layout are two plans (the
    cache table holds addresses), so each call writes its own caches and only those."""
    g = make_generator(8, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=1, D=16, H=24, R=16, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.float32)
    states, positions, slots = torch.randn(3, 24, generator=g), torch.arange(3), torch.tensor([5, 0, 2])
    sets = [[torch.zeros(2, 4, 1, 16) for _ in range(4)] for _ in range(2)]
    for caches in sets:
        before = [c.clone() for c in sets[0]]
        dflash_rocm.precompute_and_store_context_kv(states, positions, w, caches[:2], caches[2:], slots,
                                                    backend="triton")
        assert all(c.abs().sum() > 0 for c in caches)
        if caches is sets[1]:  # the first set is untouched by the second call
            assert all(torch.equal(c, b) for c, b in zip(sets[0], before))
    assert all(torch.equal(a, b) for a, b in zip(*sets))


def test_compute_only_call_writes_nothing_and_returns_none():
    g = make_generator(6, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=1, D=16, H=24, R=16, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.float32)
    result = dflash_rocm.precompute_and_store_context_kv(torch.randn(3, 24, generator=g), torch.arange(3), w,
                                                         None, None, None, backend="triton")
    assert result is None


def test_backend_declares_its_limits():
    table = torch.zeros(1, 1, dtype=torch.int32)
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    lens = torch.tensor([2], dtype=torch.int32)
    for head_dim, needle in ((512, "head_dim 512 > 256"), (24, "head_dim 24 is not a multiple of 16")):
        cache = torch.zeros(1, 4, 1, head_dim)
        reasons = dflash_rocm.explain("draft_attention", torch.zeros(2, 2, head_dim), cache, cache, table, qsl,
                                      lens)["triton"]
        assert needle in reasons
    cache = torch.zeros(1, 4, 1, 16)
    reasons = dflash_rocm.explain("draft_attention", torch.zeros(2, 32, 16), cache, cache, table, qsl, lens)
    assert "GQA ratio 32 > 16" in reasons["triton"] and reasons["reference"] == []


def test_nope_layers_past_the_kernels_bit_mask_are_declined_and_served_below_it():
    """The kernel holds the NoPE layers as bits of one int64 constant: layer 62 is served (and
    matches the reference); a NoPE layer 63 or later is a reason, also right after a call of
    the same shapes was served (the variants are part of the call's structure)."""
    from dflash_rocm.backends.triton.precompute import MAX_NOPE_LAYER

    g = make_generator(5, "cpu")
    L = MAX_NOPE_LAYER + 2
    w = make_weights(g, "cpu", L=L, Hk=1, D=16, H=16, R=16, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.float32)
    args = (torch.randn(3, 16, generator=g), torch.tensor([5, 9, 700]))

    def with_nope(layer):
        return dataclasses.replace(w, rope_layers=tuple(i != layer for i in range(L)))

    def k_of(weights, backend):
        return dflash_rocm.precompute_and_store_context_kv(*args, weights, None, None, None, return_kv=True,
                                                           backend=backend)[0]

    served = with_nope(MAX_NOPE_LAYER)
    ref = k_of(served, "reference")
    assert dflash_rocm.contract.relative_error(k_of(served, "triton")[MAX_NOPE_LAYER], ref[MAX_NOPE_LAYER]) < 1e-5
    with pytest.raises(dflash_rocm.BackendUnavailable, match=f"NoPE layers past layer {MAX_NOPE_LAYER}"):
        k_of(with_nope(L - 1), "triton")
    assert dflash_rocm.explain("precompute_and_store_context_kv", *args, with_nope(L - 1), None, None,
                               None)["reference"] == []


def test_index_tensors_of_either_int_width():
    """int64 block tables and query_start_loc, int32 slot mappings, and a per-layer list
    mixing both widths all reach the kernels correctly."""
    q, kc, vc, table, qsl, lens = paged([21, 9], [5, 3], Hk=1, G=2, D=16, block_size=4)
    ref = dflash_rocm.draft_attention(q, kc, vc, table, qsl, lens, backend="reference")
    out = dflash_rocm.draft_attention(q, kc, vc, table.long(), qsl.long(), lens.long(), backend="triton")
    assert dflash_rocm.contract.relative_error(out, ref) < 2e-3

    g = make_generator(8, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=1, D=16, H=24, R=16, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.float32)
    states = torch.randn(4, 24, generator=g)
    slots = torch.tensor([5, -1, 0, 9])
    for mapping in (slots.int(), [slots.int(), slots.long()]):
        got = [torch.zeros(3, 4, 1, 16) for _ in range(4)]
        want = [torch.zeros(3, 4, 1, 16) for _ in range(4)]
        dflash_rocm.precompute_and_store_context_kv(states, torch.arange(4), w, got[:2], got[2:], mapping,
                                                    backend="triton")
        dflash_rocm.precompute_and_store_context_kv(states, torch.arange(4), w, want[:2], want[2:], slots,
                                                    backend="reference")
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("layout", ["views of one row", "one tensor", "views and another", "apart"])
def test_per_layer_slot_mappings_that_are_views_of_one_row_are_one_mapping(layout):
    """vLLM 0.34 passes each draft layer its own slice of its KV-cache group's slot row:
    different tensor objects over the same memory. Validation makes them one mapping (one
    object, as the structure counts them), so the plan passes it as is and every layer
    reads its own slots; mappings that differ are stacked. Each layout twice, through
    dispatch's kept plan, against the reference."""
    g = make_generator(9, "cpu")
    L = 3
    w = make_weights(g, "cpu", L=L, Hk=1, D=16, H=24, R=16, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.float32)
    states, positions = torch.randn(4, 24, generator=g), torch.arange(4)
    group = torch.tensor([[5, 0, 9, 2], [1, 7, 3, 10]])  # two groups' slot rows
    mappings = {"views of one row": [group[0][:] for _ in range(L)],
                "one tensor": [group[0]] * L,
                "views and another": [group[0][:], group[0][:], group[1]],
                "apart": [group[0].clone(), group[1], group[0].flip(0)]}[layout]
    call = dflash_rocm.ops.precompute.validation.precompute_call(
        states, positions, w, [torch.zeros(3, 4, 1, 16) for _ in range(L)],
        [torch.zeros(3, 4, 1, 16) for _ in range(L)], mappings)
    shared = layout in ("views of one row", "one tensor")
    assert (call.slot_mappings[0] is call.slot_mappings[2]) == shared
    assert (call.slot_mappings[0] is call.slot_mappings[1]) == (layout != "apart")
    for _ in range(2):
        got = [torch.zeros(3, 4, 1, 16) for _ in range(2 * L)]
        want = [torch.zeros(3, 4, 1, 16) for _ in range(2 * L)]
        dflash_rocm.precompute_and_store_context_kv(states, positions, w, got[:L], got[L:], mappings,
                                                    backend="triton")
        dflash_rocm.precompute_and_store_context_kv(states, positions, w, want[:L], want[L:], mappings,
                                                    backend="reference")
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("block_n,window,fp16_dots,k_at_load", [
    (16, None, False, False), (32, 21, False, False), (16, None, True, False), (32, 21, True, False),
    (16, None, False, True), (32, 21, True, True)])
def test_fp8_keys_widened_in_the_operand_layout_match_the_reference(block_n, window, fp16_dots, k_at_load):
    """fp8 caches with fp16 queries take the GPU path under the interpreter: K loaded as
    K^T and widened after the layout change (or, ``k_at_load``, in its load layout), V as
    on a GPU; masked last tiles, a window; with ``fp16_dots`` the query is pre-scaled (the
    scores then in the exponents' units)."""
    from dflash_rocm.backends.triton.attention import run_draft_attention
    from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig
    from dflash_rocm.launches import capture
    from dflash_rocm.ops.attention import attention_call

    q, kc, vc, *rest = paged([75, 33], [16, 7], Hk=2, G=4, D=64, block_size=16, dtype=torch.float16)
    kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    args = (q, kc, vc, *rest)
    kwargs = dict(sliding_window=window, k_scale=torch.tensor(0.5), v_scale=torch.tensor(2.0))
    config = AttentionLaunchConfig(block_m=64, block_n=block_n, num_segments=2, fp16_dots=fp16_dots,
                                   fp8_k_at_load=k_at_load)
    with capture() as launches:
        run_draft_attention(attention_call(*args, **kwargs), config)
    assert launches[0].constexprs["IS_FP8"] and not launches[0].constexprs["FP32_MATH"]
    assert launches[0].constexprs["FP16_DOTS"] == fp16_dots
    assert launches[0].constexprs["K_AT_LOAD"] == k_at_load
    call = attention_call(*args, **kwargs)
    run_draft_attention(call, config)
    ref = dflash_rocm.draft_attention(*args, **kwargs, backend="reference")
    assert dflash_rocm.contract.relative_error(call.out, ref) < 5e-3


# (config field, the kernel's constexpr, (query dtype, fp8 cache, switched on) cases)
FP8_CACHE_SWITCHES = {
    # fp8 K widened at its load: fp8 caches on the GPU path only (a 16-bit cache has nothing
    # to widen and keeps the kernel compiled without it; FP32_MATH widens every operand anyway)
    "fp8_k_at_load": ("K_AT_LOAD", ((torch.float16, True, True), (torch.bfloat16, True, False),
                                    (torch.float16, False, False))),
    # fp16 products where they lose nothing: fp8 caches (which fp16 holds exactly) and 16-bit
    # queries; fp32 queries and bf16 caches keep their dtypes
    "fp16_dots": ("FP16_DOTS", ((torch.float16, True, True), (torch.float32, True, False),
                                (torch.float16, False, False))),
}


@pytest.mark.parametrize("field", FP8_CACHE_SWITCHES)
def test_fp8_cache_switches_apply_only_where_they_lose_nothing(field):
    """A config's fp8-cache switches reach the kernel only for the caches and queries they
    serve (see :data:`FP8_CACHE_SWITCHES`)."""
    from dflash_rocm.backends.triton.attention import plan_attention
    from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig
    from dflash_rocm.ops.attention import attention_call

    constexpr, cases = FP8_CACHE_SWITCHES[field]
    config = AttentionLaunchConfig(block_m=32, block_n=16, **{field: True})
    for dtype, fp8, expected in cases:
        q, kc, vc, *rest = paged([20], [4], Hk=1, G=4, D=32, block_size=16, dtype=dtype)
        if fp8:
            kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        plan = plan_attention(*record_for("draft_attention", "triton", attention_call(q, kc, vc, *rest)), config)
        assert plan.main.constexprs[constexpr] == expected, (dtype, fp8)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 5e-3), (torch.float32, 2e-3), (torch.bfloat16, 2e-2)])
def test_only_bf16_upcasts_under_the_interpreter_so_fp16_and_fp32_run_the_gpu_path(dtype, tol):
    """numpy computes fp16 and fp32 natively: those launches keep FP32_MATH off and run the
    casts a GPU runs (P rounded to V's type, fp16 dots); only bf16 computes in float32."""
    from dflash_rocm.backends.triton.attention import run_draft_attention
    from dflash_rocm.launches import capture
    from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig, PrecomputeLaunchConfig
    from dflash_rocm.backends.triton.precompute import run_precompute
    from dflash_rocm.ops.attention import attention_call
    from dflash_rocm.ops.precompute import precompute_call

    args = paged([90, 41], [16, 7], Hk=2, G=4, D=64, block_size=16, dtype=dtype)
    attn = AttentionLaunchConfig(block_m=64, block_n=16, num_segments=2)
    g = make_generator(9, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=2, D=32, H=64, R=32, is_neox=True, bias=False, v_scale=None, dtype=dtype)
    caches = [torch.zeros(3, 16, 2, 32, dtype=dtype) for _ in range(4)]
    pre_args = (torch.randn(20, 64, generator=g).to(dtype), torch.arange(20), w, caches[:2], caches[2:],
                torch.randperm(48, generator=g)[:20])
    pre = PrecomputeLaunchConfig(block_t=32, block_k=16, split_k=2)
    with capture() as launches:
        run_draft_attention(attention_call(*args), attn)
        run_precompute(precompute_call(*pre_args, return_kv=True), pre)
    assert {launch.constexprs["FP32_MATH"] for launch in launches} == {dtype == torch.bfloat16}
    call = attention_call(*args)
    run_draft_attention(call, attn)
    ref = dflash_rocm.draft_attention(*args, backend="reference")
    assert dflash_rocm.contract.relative_error(call.out, ref) < tol
    k, v = run_precompute(precompute_call(*pre_args, return_kv=True), pre)
    rk, rv = dflash_rocm.precompute_and_store_context_kv(*pre_args[:3], None, None, None, return_kv=True,
                                                         backend="reference")
    assert max(dflash_rocm.contract.relative_error(k, rk), dflash_rocm.contract.relative_error(v, rv)) < tol


@pytest.mark.parametrize("neox", [True, False])
def test_the_normed_k_is_rounded_before_rope_exactly_when_the_weights_say_so(neox):
    """``round_k_before_rope`` moves half a unit of the states' dtype, which no tolerance
    sees: compare elements instead. fp16 (the interpreter converts float32 to bf16 by
    truncation, a GPU rounds to nearest) and a hidden norm weight of ones (its fold into the
    K/V rows is then exact), so the kernel and the reference differ only in summation order:
    the kernel's K equals the reference's with the same flag almost everywhere, and the
    reference's with the other flag in far fewer elements."""
    g = make_generator(17, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=2, D=32, H=64, R=32, is_neox=neox, bias=False, v_scale=None,
                     dtype=torch.float16)
    w = dataclasses.replace(w, hidden_norm_weight=torch.ones(64, dtype=torch.float16))
    states, positions = torch.randn(32, 64, generator=g).half(), torch.randint(1, 4096, (32,), generator=g)

    def k_of(rounded: bool, backend: str) -> torch.Tensor:
        weights = dataclasses.replace(w, round_k_before_rope=rounded)
        return dflash_rocm.precompute_and_store_context_kv(states, positions, weights, None, None, None,
                                                           return_kv=True, backend=backend)[0]

    for rounded in (False, True):
        got = k_of(rounded, "triton")
        differ_same = (got != k_of(rounded, "reference")).float().mean().item()
        differ_other = (got != k_of(not rounded, "reference")).float().mean().item()
        assert differ_same * 10 < differ_other, (rounded, differ_same, differ_other)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fnuz, torch.float8_e4m3fn], ids=str)
def test_a_value_rounding_to_zero_is_stored_as_zero_in_an_fp8_cache(cache_dtype):
    """The interpreter's fp8 epilogue rounds by arithmetic (``_round_to_fp8_grid``); a tiny
    negative value rounds to zero, which must be stored as +0: in the fnuz formats 0x80 is
    NaN, and Triton 3.8's interpreter converts -0.0 to 0x80 (3.9's to 0x00)."""
    from divide_kernel import fp8_round_kernel

    from dflash_rocm.backends.triton.precompute import _FP8_MIN_NORMAL_EXP

    x = torch.tensor([-1e-9, -1e-30, -0.0, 0.0, 1e-9, -0.5, 0.5, -1.94, 3.0, -300.0, 1e-3, -1e-3, 0.0, 0.0, 0.0, 0.0])
    y = torch.empty(x.shape, dtype=cache_dtype)
    fp8_round_kernel[(1,)](x, y, MIN_EXP=_FP8_MIN_NORMAL_EXP[cache_dtype], BLOCK=x.numel())
    assert not torch.isnan(y.float()).any(), y.view(torch.uint8).tolist()
    finite = x.abs() <= torch.finfo(cache_dtype).max
    assert torch.equal(y.float()[finite], x.to(cache_dtype).float()[finite])
