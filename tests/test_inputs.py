"""Adversarial inputs: every call is served correctly or refused before any write.

Strided and aliased tensors, non-finite scalars, the meta device. Each case here was
wrong silently or crashed before the validation learned about it.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dflash_rocm
from checks import bits, check_attention, check_precompute, rel_err
from dflash_rocm.platform import simulate_platform
from strategies import CPU_SIZES, attention_cases, precompute_cases, relayout, with_numpy_scalars
from support import SERVING_HERE, needs_interpreter
from test_reference import naive_attention, naive_context_kv
from test_validation import attention_args, precompute_args

BACKENDS = ["reference", pytest.param("triton", marks=needs_interpreter)]


def oracle_caches(args) -> list[torch.Tensor]:
    """The caches a precompute call leaves, from SPEC's naive loops (float64; an independent
    oracle, so the reference row is held to something other than itself): every layer's K
    and V at its slots, the rest untouched."""
    k, v = naive_context_kv(args["context_states"], args["positions"], args["weights"])
    slots = args["slot_mapping"]
    out = []
    for caches, values in ((args["key_caches"], k), (args["value_caches"], v)):
        for layer, cache in enumerate(caches):
            s = slots if isinstance(slots, torch.Tensor) else slots[layer]
            keep = s >= 0
            want = cache.clone()
            want.view(-1, *cache.shape[2:])[s[keep]] = values[layer][keep].to(cache.dtype)
            out.append(want)
    return out


def strided(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as a non-contiguous view."""
    if how == "every_other":
        return relayout(t, "padded")
    if how == "transposed":
        return relayout(t, "column_major")
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype)  # column slice of a wider table
    wide[..., 1:t.shape[-1] + 1] = t
    return wide[..., 1:t.shape[-1] + 1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arg,how", [("block_table", "transposed"), ("block_table", "column_slice"),
                                     ("block_table", "every_other"), ("query_start_loc", "every_other"),
                                     ("seq_lens", "every_other"), ("query", "transposed"),
                                     ("key_cache", "every_other"), ("out", "every_other")])
def test_strided_views_are_served_like_contiguous_tensors(backend, arg, how):
    args = attention_args()
    expected = naive_attention(*(args[k] for k in ("query", "key_cache", "value_cache", "block_table",
                                                    "query_start_loc", "seq_lens"))).float()
    args[arg] = strided(args[arg], how)
    assert not args[arg].is_contiguous()
    out = dflash_rocm.draft_attention(**args, backend=backend)
    assert rel_err(out, expected) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arg", ["slot_mapping", "positions", "context_states", "key_caches"])
def test_strided_precompute_inputs_land_in_the_right_slots(backend, arg):
    args = precompute_args()
    want = oracle_caches(args)
    if arg == "key_caches":
        args[arg] = [strided(c, "every_other") for c in args[arg]]
    else:
        args[arg] = strided(args[arg], "every_other")
    dflash_rocm.precompute_and_store_context_kv(**args, backend=backend)
    for got, ref in zip(args["key_caches"] + args["value_caches"], want):
        assert rel_err(got, ref) < 1e-5


def aliasing_outs(args):
    kc, q = args["key_cache"], args["query"]
    return {
        "out in key_cache": kc.view(-1)[:q.numel()].view(q.shape),
        "out is query": q,
        "out expanded": torch.zeros(1, 1, q.shape[2]).expand(q.shape),
        "out overlapping rows": torch.zeros(q.numel()).as_strided(q.shape, (q.shape[2], q.shape[2], 1)),
    }


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("case", list(aliasing_outs(attention_args())))
def test_an_out_that_aliases_what_the_call_reads_or_itself_is_refused(backend, case):
    args = attention_args()
    args["out"] = aliasing_outs(args)[case]
    before = [bits(args[k]).clone() for k in ("query", "key_cache", "value_cache")]
    with pytest.raises(ValueError, match="out"):
        dflash_rocm.draft_attention(**args, backend=backend)
    for b, k in zip(before, ("query", "key_cache", "value_cache")):
        assert torch.equal(b, bits(args[k]))


def test_views_into_separate_parts_of_one_buffer_are_accepted():
    """vLLM's caches are views into one buffer: K and V halves (FlashAttention layout) and
    K transposed then V per page (CPU layout) do not overlap, and must not be refused."""
    args = attention_args()
    nb, bs, hk, d = args["key_cache"].shape
    fa = torch.randn(nb, hk, bs, 2 * d)  # vLLM's logical [blocks, Hk, bs, 2D]
    k, v = fa.transpose(1, 2).split(d, dim=-1)
    out = dflash_rocm.draft_attention(**{**args, "key_cache": k, "value_cache": v, "out": None}, backend="reference")
    buffer = torch.zeros(2 * out.numel())
    dflash_rocm.draft_attention(**{**args, "key_cache": k, "value_cache": v,
                                   "out": buffer[out.numel():].view(out.shape)},
                                backend="reference")

    def cpu_layout():  # vLLM CPU: per (block, head) page, K^T [D, bs] then V [bs, D]
        pages = torch.randn(nb, hk, 2, bs * d)
        return (pages[:, :, 0].view(nb, hk, d, bs).permute(0, 3, 1, 2),
                pages[:, :, 1].view(nb, hk, bs, d).permute(0, 2, 1, 3))
    p = precompute_args()
    (k0, v0), (k1, v1) = cpu_layout(), cpu_layout()
    p["key_caches"], p["value_caches"] = [k0, k1], [v0, v1]
    dflash_rocm.precompute_and_store_context_kv(**p, backend="reference")


@pytest.mark.parametrize("case", ["k is v", "k overlaps v", "expanded blocks", "layers share a cache"])
def test_caches_that_alias_are_refused_before_any_write(case):
    args = precompute_args()
    kc, vc = args["key_caches"], args["value_caches"]
    if case == "k is v":
        vc[0] = kc[0]
    elif case == "k overlaps v":
        flat = torch.zeros(kc[0].numel() + 16)
        kc[0], vc[0] = flat[:kc[0].numel()].view(kc[0].shape), flat[16:].view(kc[0].shape)
    elif case == "expanded blocks":
        kc[1] = torch.zeros(1, *kc[1].shape[1:]).expand(kc[1].shape)
    else:
        kc[1] = kc[0]
    before = [bits(c).clone() for c in kc + vc]
    with pytest.raises(ValueError, match="caches"):
        dflash_rocm.precompute_and_store_context_kv(**args)
    assert all(torch.equal(b, bits(c)) for b, c in zip(before, kc + vc))


@pytest.mark.parametrize("backend", ["reference", "cpu", pytest.param("triton", marks=needs_interpreter)])
def test_layers_with_their_own_slot_mappings_may_share_one_cache(backend):
    """vLLM's hybrid KV-cache groups (a draft with sliding and full layers) give layers of
    different groups one pool, each writing its own group's slots: served, each layer's
    rows at its own slots. One mapping shared by layers that share a cache is refused."""
    args = precompute_args()
    slots = [torch.tensor([0, 5, -1, 11, 2]), torch.tensor([1, 6, 7, -1, 3])]
    shared_k, shared_v = torch.zeros_like(args["key_caches"][0]), torch.zeros_like(args["value_caches"][0])
    args.update(key_caches=[shared_k, shared_k], value_caches=[shared_v, shared_v], slot_mapping=slots)
    dflash_rocm.precompute_and_store_context_kv(**args, backend=backend)
    k, v = naive_context_kv(args["context_states"], args["positions"], args["weights"])  # an independent oracle
    bs = shared_k.shape[1]
    for layer, s in enumerate(slots):
        keep = s >= 0
        rows = s[keep]
        assert rel_err(shared_k[rows // bs, rows % bs], k[layer][keep]) < 1e-5
        assert rel_err(shared_v[rows // bs, rows % bs], v[layer][keep]) < 1e-5
    args["slot_mapping"] = [slots[0], slots[0]]
    with pytest.raises(ValueError, match="key_caches"):
        dflash_rocm.precompute_and_store_context_kv(**args, backend=backend)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_fp8_scale_tensors_must_hold_positive_finite_values(value):
    args = attention_args()
    args["key_cache"] = args["key_cache"].to(torch.float8_e4m3fn)
    args["value_cache"] = args["value_cache"].to(torch.float8_e4m3fn)
    out_before = args["out"].clone()
    with pytest.raises(ValueError, match="k_scale"):
        dflash_rocm.draft_attention(**args, k_scale=torch.tensor([value]), backend="reference")
    assert torch.equal(out_before, args["out"])
    p = precompute_args()
    p["key_caches"] = [c.to(torch.float8_e4m3fn) for c in p["key_caches"]]
    p["value_caches"] = [c.to(torch.float8_e4m3fn) for c in p["value_caches"]]
    before = [bits(c).clone() for c in p["key_caches"]]
    with pytest.raises(ValueError, match="v_scales"):
        dflash_rocm.precompute_and_store_context_kv(**p, v_scales=torch.tensor([1.0, value]))
    assert all(torch.equal(b, bits(c)) for b, c in zip(before, p["key_caches"]))
    with pytest.raises(ValueError, match="k_scales"):
        dflash_rocm.precompute_and_store_context_kv(**p, k_scales=[1.0, value])


@pytest.mark.parametrize("name,value,error", [("sliding_window", 2**64, ValueError),
                                              ("sliding_window", 2**31, ValueError),
                                              ("max_seq_len", 2**40, ValueError), ("max_query_len", -1, ValueError),
                                              ("max_seq_len", True, TypeError), ("scale", float("inf"), ValueError)])
def test_scalars_out_of_range_are_refused(name, value, error):
    with pytest.raises(error, match=name):
        dflash_rocm.draft_attention(**attention_args(), **{name: value})


@pytest.mark.parametrize("backend", SERVING_HERE)
@pytest.mark.parametrize("scale", [0.0, -0.125, -float("inf"), 1e-45, 1e39])
def test_a_scale_that_is_not_a_positive_float32_is_refused_on_every_backend(backend, scale):
    """Kernels apply the scale in each exponent, in float32: a non-positive one made every
    row NaN, and one that float32 flushes to 0 or inf would too."""
    args = attention_args()
    before = args["out"].clone()
    with simulate_platform("gfx942"), pytest.raises(ValueError, match="scale: expected a positive finite scale"):
        dflash_rocm.draft_attention(**args, scale=scale, backend=backend)
    assert torch.equal(args["out"], before)


def test_meta_tensors_are_refused_with_a_clear_error():
    args = {k: v.to("meta") for k, v in attention_args().items()}
    with pytest.raises(ValueError, match="meta device"):
        dflash_rocm.draft_attention(**args)
    p = precompute_args()
    with pytest.raises(ValueError, match="meta device"):
        dflash_rocm.precompute_and_store_context_kv(**{**p, "context_states": p["context_states"].to("meta"),
                                                       "weights": p["weights"]})


def test_aliasing_is_judged_per_call_not_only_per_structure():
    """A structure checked once must not let a later call of the same shapes through when
    its tensors alias: addresses are part of the verdict."""
    args = precompute_args()
    dflash_rocm.precompute_and_store_context_kv(**args)
    args["value_caches"][0] = args["key_caches"][0]
    with pytest.raises(ValueError, match="shares memory"):
        dflash_rocm.precompute_and_store_context_kv(**args)
    a = attention_args()
    dflash_rocm.draft_attention(**a)
    a["out"] = a["query"]
    with pytest.raises(ValueError, match="out"):
        dflash_rocm.draft_attention(**a)
    p = precompute_args()
    p["context_states"] = p["key_caches"][1].view(-1)[:p["context_states"].numel()].view(p["context_states"].shape)
    with pytest.raises(ValueError, match="context_states"):
        dflash_rocm.precompute_and_store_context_kv(**p)


@pytest.mark.parametrize("backend", SERVING_HERE)
@given(data=st.data())
def test_numpy_scalars_are_served_as_the_python_numbers_they_hold(backend, data):
    with simulate_platform("gfx942"):
        check_attention(data.draw(with_numpy_scalars(data.draw(attention_cases(CPU_SIZES)))), backend)
        check_precompute(data.draw(with_numpy_scalars(data.draw(precompute_cases(CPU_SIZES)))), backend)


@pytest.mark.parametrize("backend", SERVING_HERE)
def test_a_written_tensor_that_requires_grad_is_refused_on_every_backend(backend):
    """The operations write in place and have no backward: reference and cpu raised
    autograd's RuntimeError mid-call. Each is first served without grad, so the refusal
    cannot come from a check that ran once for the call's shapes."""
    args, p = attention_args(), precompute_args()
    with simulate_platform("gfx942"):
        dflash_rocm.draft_attention(**args, backend=backend)
        dflash_rocm.precompute_and_store_context_kv(**p, backend=backend)
        plan = dflash_rocm.plan_draft_attention(**args, backend=backend)
        out = args["out"].clone().requires_grad_()
        with pytest.raises(ValueError, match="out: requires grad"):
            dflash_rocm.draft_attention(**{**args, "out": out}, backend=backend)
        with pytest.raises(ValueError, match="requires grad"):
            plan.run(args["query"], args["key_cache"], args["value_cache"], out=out)
        p["value_caches"][1].requires_grad_()
        before = [bits(c.detach()).clone() for c in p["key_caches"] + p["value_caches"]]
        with pytest.raises(ValueError, match=r"value_caches\[1\]: requires grad"):
            dflash_rocm.precompute_and_store_context_kv(**p, backend=backend)
    assert all(torch.equal(b, bits(c.detach())) for b, c in zip(before, p["key_caches"] + p["value_caches"]))
