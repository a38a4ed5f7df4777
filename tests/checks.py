"""Run a backend and the reference on the same case and check SPEC.md's guarantees:
agreement within the dtype's tolerance, every output element written, and every
cache byte outside the mapped slots unchanged."""

from __future__ import annotations

import torch

import dflash_rocm
from dflash_rocm.contract import FP8_DTYPES
from dflash_rocm.ops.attention import attention_call
from dflash_rocm.ops.precompute import precompute_call
from dflash_rocm.paged import PackedCache, logical, memory_of, read_rows

from dflash_rocm.contract import TOLERANCES as TOLERANCE
from dflash_rocm.contract import relative_error as rel_err
from dflash_rocm.contract import spec_tolerance as tolerance


def clone_arg(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, PackedCache):
        return PackedCache(x.view.clone())
    if isinstance(x, (list, tuple)):
        return type(x)(clone_arg(v) for v in x)
    return x


def bits(t: torch.Tensor | PackedCache) -> torch.Tensor:
    """The bytes of ``t`` in logical order (``[blocks, bs, Hk, D * bytes]`` for a cache),
    whatever its strides or packing."""
    return logical(t).contiguous().view(torch.uint8)


def poison(t: torch.Tensor | PackedCache) -> None:
    """Fill with a value no backend computes: NaN (0x7F is NaN in e4m3fn, 0x80 in e4m3fnuz)."""
    t = memory_of(t)
    if t.dtype == torch.float8_e4m3fn:
        t.copy_(torch.full(t.shape, 0x7F, dtype=torch.uint8, device=t.device).view(t.dtype))
    elif t.dtype == torch.float8_e4m3fnuz:
        t.copy_(torch.full(t.shape, 0x80, dtype=torch.uint8, device=t.device).view(t.dtype))
    else:
        t.fill_(float("nan"))


def check_attention(case, backend: str, run=None) -> float:
    """Run ``backend`` on ``case`` (or ``run(call)``, which must write ``call.out``, e.g. a
    kernel with a pinned launch config); returns the relative error against the reference."""
    query, key_cache, value_cache = case.args[:3]
    ref_kwargs = {k: clone_arg(v) for k, v in case.kwargs.items() if k != "out"}
    ref = dflash_rocm.draft_attention(*clone_arg(case.args), **ref_kwargs, backend="reference")
    kwargs = dict(case.kwargs)
    out = kwargs.pop("out", None)
    if out is None:
        out = torch.empty_like(query)
    poison(out)
    k_before, v_before = bits(key_cache).clone(), bits(value_cache).clone()
    if run is None:
        result = dflash_rocm.draft_attention(*case.args, **kwargs, out=out, backend=backend)
        assert result is out, "draft_attention must return the out tensor it wrote"
    else:
        run(attention_call(*case.args, **kwargs, out=out))
    assert not torch.isnan(out.float()).any(), f"output rows left unwritten or NaN: {case.description}"
    assert torch.isfinite(out.float()).all(), f"non-finite output: {case.description}"
    assert torch.equal(bits(key_cache), k_before), "attention wrote key_cache"
    assert torch.equal(bits(value_cache), v_before), "attention wrote value_cache"
    err = rel_err(out, ref) if out.numel() else 0.0
    tol = tolerance(query.dtype, key_cache.dtype)
    assert err <= tol, f"{backend} vs reference: rel err {err:.2e} > {tol:.0e} for {case.description}"
    return err


def written_rows(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    keep = slots >= 0
    s = slots[keep].long()
    return keep, s // block_size, s % block_size


def check_precompute(case, backend: str, run=None) -> float:
    """Run ``backend`` on ``case`` (or ``run(call)``); returns the worst relative error
    against the reference."""
    states, positions, weights, key_caches, value_caches, slot_mapping = case.args
    ref_k, ref_v = dflash_rocm.precompute_and_store_context_kv(
        states, positions, weights, None, None, None, backend="reference", return_kv=True)
    for c in list(key_caches) + list(value_caches):
        poison(c)
    before = [bits(c).clone() for c in list(key_caches) + list(value_caches)]
    if run is None:
        result = dflash_rocm.precompute_and_store_context_kv(*case.args, **case.kwargs, backend=backend)
    else:
        result = run(precompute_call(*case.args, **case.kwargs))
    cache_dtype = key_caches[0].dtype
    tol = tolerance(states.dtype, cache_dtype)
    errors = [0.0]
    if case.kwargs.get("return_kv"):
        k, v = result
        assert k.shape == ref_k.shape and v.shape == ref_v.shape and k.dtype == states.dtype
        errors += [rel_err(k, ref_k), rel_err(v, ref_v)]
        assert max(errors) <= TOLERANCE[states.dtype], f"return_kv error {errors} for {case.description}"
    else:
        assert result is None
    L = weights.num_layers
    scales_k = case.kwargs.get("k_scales") or [1.0] * L
    scales_v = case.kwargs.get("v_scales") or [1.0] * L
    for layer, slots in enumerate(case.slot_mappings):
        for caches, old, ref, scales in ((key_caches, before[:L], ref_k, scales_k),
                                         (value_caches, before[L:], ref_v, scales_v)):
            cache, prior = caches[layer], old[layer]
            touched = torch.zeros(cache.shape[:2], dtype=torch.bool, device=cache.device)
            if slots is not None:
                keep, blocks, rows = written_rows(slots, cache.shape[1])
                touched[blocks, rows] = True
                got = read_rows(cache, blocks, rows).float() * (scales[layer] if cache.dtype in FP8_DTYPES else 1.0)
                want = ref[layer][keep].float()
                if want.numel():
                    assert not torch.isnan(got).any(), f"slot left unwritten, layer {layer}: {case.description}"
                    errors.append(rel_err(got, want))
            untouched_now = bits(cache)[~touched]
            untouched_before = prior[~touched]
            assert torch.equal(untouched_now, untouched_before), (
                f"{backend} wrote outside the mapped slots of layer {layer}: {case.description}")
    assert max(errors) <= tol, f"{backend} vs reference: rel err {max(errors):.2e} > {tol:.0e}: {case.description}"
    return max(errors)
