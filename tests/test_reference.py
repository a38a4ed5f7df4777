"""The reference backend against a deliberately naive, loop-by-loop reading of SPEC.md."""

import math

import torch
from hypothesis import given, settings

import dflash_rocm
from checks import rel_err, bits
from dflash_rocm.contract import FP8_DTYPES
from dflash_rocm.paged import logical
from strategies import CPU_SIZES, PACKINGS, WEIGHT_FORMATS, Sizes, attention_cases, precompute_cases

TINY = Sizes(max_seqs=2, max_query=4, max_context=12, head_dims=(8,), block_sizes=(1, 3, 4),
             queries_per_kv=(1, 2, 3), max_tokens=5, hidden_sizes=(12,), max_layers=2)


def naive_attention(query, key_cache, value_cache, block_table, qsl, seq_lens, *, scale=None, causal=False,
                    sliding_window=None, sinks=None, k_scale=None, v_scale=None, out=None):
    T, Hq, D = query.shape
    Hk, bs = key_cache.shape[2], key_cache.shape[1]
    scale = D ** -0.5 if scale is None else scale
    fp8 = key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    ks = (k_scale or 1.0) if fp8 else 1.0
    vs = (v_scale or 1.0) if fp8 else 1.0
    result = torch.zeros(T, Hq, D, dtype=torch.float64)
    for b in range(len(seq_lens)):
        q0, q1, S = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        for i in range(q1 - q0):
            p = S - (q1 - q0) + i
            for h in range(Hq):
                kvh = h // (Hq // Hk)
                logits, values = [], []
                for j in range(S):
                    if causal and j > p:
                        continue
                    if sliding_window is not None and j <= p - sliding_window:
                        continue
                    blk, row = int(block_table[b, j // bs]), j % bs
                    k = key_cache[blk, row, kvh].double() * ks
                    logits.append(scale * float((query[q0 + i, h].double() * k).sum()))
                    values.append(value_cache[blk, row, kvh].double() * vs)
                m = max(logits + ([float(sinks[h])] if sinks is not None else []))
                weights = [math.exp(x - m) for x in logits]
                denom = sum(weights) + (math.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
                for w, v in zip(weights, values):
                    result[q0 + i, h] += w / denom * v
    return result


def naive_context_kv(states, positions, w):
    N, L, Hk, D, R = states.shape[0], w.num_layers, w.num_kv_heads, w.head_dim, w.rotary_dim
    k_out = torch.zeros(L, N, Hk, D, dtype=torch.float64)
    v_out = torch.zeros(L, N, Hk, D, dtype=torch.float64)
    rows = 2 * Hk * D
    for n in range(N):
        x = states[n].double()
        cs = w.cos_sin_cache[int(positions[n])].double()
        for layer in range(L):
            norm = w.hidden_norm_weight[layer] if w.hidden_norm_weight.dim() == 2 else w.hidden_norm_weight
            xn = x / math.sqrt(float((x * x).mean()) + w.eps) * norm.double()
            weight = w.kv_weight[layer * rows:(layer + 1) * rows].double()
            if w.kv_weight_scale is not None:  # fp8 rows: each row times its scale (one for all, or its own)
                scale = w.kv_weight_scale.double().reshape(-1)
                weight = weight * (scale if scale.numel() == 1 else scale[layer * rows:(layer + 1) * rows])[:, None]
            kv = weight @ xn
            if w.kv_bias is not None:
                kv = kv + w.kv_bias[layer * rows:(layer + 1) * rows].double()
            for h in range(Hk):
                k = kv[h * D:h * D + D]
                v = kv[Hk * D + h * D:Hk * D + h * D + D]
                k = k / math.sqrt(float((k * k).mean()) + w.eps) * w.k_norm_weight[layer].double()
                if w.round_k_before_rope:
                    k = k.to(states.dtype).double()
                rotated = k.clone()
                pairs = R // 2 if w.rope_layers is None or w.rope_layers[layer] else 0  # a NoPE layer rotates none
                for i in range(pairs):
                    c, s = float(cs[i]), float(cs[R // 2 + i])
                    a, b = (i, i + R // 2) if w.is_neox else (2 * i, 2 * i + 1)
                    rotated[a] = k[a] * c - k[b] * s
                    rotated[b] = k[b] * c + k[a] * s
                k_out[layer, n, h] = rotated
                v_out[layer, n, h] = v * (w.v_scale if w.v_scale is not None else 1.0)
    return k_out, v_out


@given(attention_cases(TINY, dtypes=(torch.float32,), packings=PACKINGS))
def test_reference_attention_matches_naive_loops(case):
    ref = dflash_rocm.draft_attention(*case.args, **case.kwargs, backend="reference")
    args = [logical(a) if i in (1, 2) else a for i, a in enumerate(case.args)]  # naive loops read plain caches
    naive = naive_attention(*args, **{k: v for k, v in case.kwargs.items() if k != "out"})
    assert rel_err(ref, naive) < 1e-5, case.description


@given(precompute_cases(TINY, dtypes=(torch.float32,), weight_formats=(None, *WEIGHT_FORMATS)))
def test_reference_context_kv_matches_naive_loops(case):
    states, positions, weights = case.args[:3]
    k, v = dflash_rocm.precompute_and_store_context_kv(states, positions, weights, None, None, None,
                                                       return_kv=True, backend="reference")
    nk, nv = naive_context_kv(states, positions, weights)
    assert rel_err(k, nk) < 1e-5 and rel_err(v, nv) < 1e-5, case.description


def stored_codes(values: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """SPEC's stored value: a float cache holds the values in its dtype (the states'); an
    fp8 cache holds ``(x / scale).to(fp8)``, saturated at the format's largest finite value."""
    if cache_dtype not in FP8_DTYPES:
        return values.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return (values.float() / scale).clamp(-limit, limit).to(cache_dtype)


def check_mapped_slots(case):
    """Slot s lands in block s // block_size, row s % block_size, holding exactly SPEC's
    stored value of that token's K and V (the bits of a float cache, the codes of an fp8
    one); -1 and None layers skip (packed caches read back through their logical view)."""
    kcs, vcs = case.key_caches, case.value_caches
    before = [logical(c).clone() for c in kcs + vcs]
    k, v = dflash_rocm.precompute_and_store_context_kv(*case.args, backend="reference",
                                                       **{**case.kwargs, "return_kv": True})
    L = len(kcs)
    for caches, values, scales, shift in ((kcs, k, case.kwargs.get("k_scales"), 0),
                                          (vcs, v, case.kwargs.get("v_scales"), L)):
        for layer, slots in enumerate(case.slot_mappings):
            cache = logical(caches[layer])
            bs = cache.shape[1]
            written = {s: n for n, s in enumerate(slots.tolist()) if s >= 0} if slots is not None else {}
            for slot in range(cache.shape[0] * bs):
                got = cache[slot // bs, slot % bs]
                if slot not in written:
                    want = before[shift + layer][slot // bs, slot % bs]
                else:
                    want = stored_codes(values[layer, written[slot]], cache.dtype, (scales or [1.0] * L)[layer])
                assert torch.equal(bits(got), bits(want)), f"layer {layer} slot {slot}: {case.description}"


@settings(max_examples=10)
@given(precompute_cases(CPU_SIZES, cache_dtypes=("same",), packings=PACKINGS))
def test_reference_writes_exactly_the_mapped_slots_of_float_caches(case):
    check_mapped_slots(case)


@settings(max_examples=10)
@given(precompute_cases(CPU_SIZES, dtypes=(torch.float32,), cache_dtypes=tuple(FP8_DTYPES), packings=PACKINGS))
def test_reference_writes_exactly_the_mapped_slots_of_fp8_caches(case):
    """float32 states: the K/V returned are the very values SPEC quantizes."""
    check_mapped_slots(case)
