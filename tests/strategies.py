"""Hypothesis strategies shared by every backend's tests.

A strategy draws the *shape* of a case (batch layout, block size, heads, features) and a
seed; the tensors are then made from the seed with torch's generator, which keeps
shrinking fast and the cases reproducible. ``Sizes`` bounds a draw: small on CPU (the
Triton interpreter runs about 1-2 ms per tile-loop iteration), larger on a GPU.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from dflash_rocm import ContextKVWeights, PackedCache
from dflash_rocm.contract import FP8_DTYPES
from dflash_rocm.rope import build_cos_sin_cache


@dataclass(frozen=True)
class Sizes:
    max_seqs: int = 3
    max_query: int = 5
    max_context: int = 40
    head_dims: tuple[int, ...] = (16, 32)
    block_sizes: tuple[int, ...] = (1, 4, 12, 16)  # 12: neither a multiple nor a divisor of a key tile
    kv_heads: tuple[int, ...] = (1, 2)
    queries_per_kv: tuple[int, ...] = (1, 2, 3, 4, 16)
    max_tokens: int = 12
    hidden_sizes: tuple[int, ...] = (24, 40, 64)
    max_layers: int = 3
    device: str = "cpu"


CPU_SIZES = Sizes()
GPU_SIZES = Sizes(max_seqs=6, max_query=17, max_context=3000, head_dims=(64, 128, 256, 80),
                  block_sizes=(1, 16, 48, 64), kv_heads=(1, 2, 8), queries_per_kv=(1, 2, 4, 8, 16),
                  max_tokens=600, hidden_sizes=(256, 1000, 4096), max_layers=5, device="cuda")

CACHE_DTYPE_CHOICES = ("same", torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def make_generator(seed: int, device: str) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def randn(shape, g: torch.Generator, device: str, dtype=torch.float32, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=device) * std).to(dtype)


LAYOUTS = ("contiguous", "padded", "column_major")


def relayout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in another memory layout: ``padded`` leaves a gap after every
    element (``t[::2]``-like strides in every dim), ``column_major`` reverses the stride
    order (a transposed copy viewed back). Backends must honour or normalise any of them."""
    if layout == "contiguous" or t.dim() == 0:
        return t
    if layout == "padded":
        buffer = torch.empty(*t.shape, 2, dtype=t.dtype, device=t.device)
        view = buffer[..., 0]
    else:
        dims = list(range(t.dim()))[::-1]
        view = torch.empty(tuple(t.shape[d] for d in dims), dtype=t.dtype, device=t.device).permute(*dims)
    view.copy_(t)
    return view


PACKINGS = ("plain", "rocm_attn", "rocm_attn_interleaved_v")


def pack_caches(key: torch.Tensor, value: torch.Tensor, packing: str):
    """``(key, value)`` in vLLM ROCM_ATTN's page layouts (paged_attn.split_kv_cache, vLLM 0.33):
    K x-packed ``[blocks, Hk, D // x, bs, x]``, V ``[blocks, Hk, D, bs]`` or, interleaved,
    ``[blocks, Hk, bs // x, D, x]``, with ``x = 16 // element_size``. A layout the shape
    cannot take (``D`` or ``bs`` not a multiple of ``x``) stays plain."""
    nb, bs, hk, d = key.shape
    x = 16 // key.element_size()
    if packing == "plain" or d % x or (packing == "rocm_attn_interleaved_v" and bs % x):
        return key, value
    k = key.contiguous().view(nb, bs, hk, d // x, x).permute(0, 2, 3, 1, 4).contiguous()
    if packing == "rocm_attn_interleaved_v":
        v = value.contiguous().view(nb, bs // x, x, hk, d).permute(0, 3, 1, 4, 2).contiguous()
        return PackedCache.x_packed_key(k), PackedCache.interleaved_value(v)
    return PackedCache.x_packed_key(k), value.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


INVISIBLE_FILLS = (None, "nan", "inf", "-inf", "huge")


def unseen_rows(block_table: torch.Tensor, q_lens: list[int], seq_lens: list[int], block_size: int,
                window: int | None, num_blocks: int) -> torch.Tensor:
    """Bool ``[num_blocks, block_size]``: the cache rows no query of the batch sees. A
    request's rows past its ``seq_len`` or before its first query's window, every row of a
    request without queries, and every block none of the requests' pages names (where
    stale block-table entries point)."""
    unseen = torch.ones(num_blocks, block_size, dtype=torch.bool)
    for b, (q, s) in enumerate(zip(q_lens, seq_lens)):
        if q:
            keys = torch.arange(0 if window is None else max(0, s - q - window + 1), s)
            unseen[block_table[b, keys // block_size].long().cpu(), keys % block_size] = False
    return unseen


def fill_value(kind: str, dtype: torch.dtype) -> float:
    """``huge`` is the cache dtype's largest finite value: a score or a product over it
    overflows like an Inf would."""
    return torch.finfo(dtype).max if kind == "huge" else float(kind)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype in FP8_DTYPES:
        return (x.float() / scale).to(dtype)
    return x.to(dtype)


@dataclass
class AttentionCase:
    """Arguments of one draft_attention call plus what the checks need."""

    args: tuple
    kwargs: dict[str, Any]
    description: str
    q_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)

    @property
    def query(self) -> torch.Tensor:
        return self.args[0]


@st.composite
def seq_layouts(draw, sizes: Sizes, block_size: int):
    """Per request ``(q_len, seq_len)``: q_len 0 and 1 included, sequences that end exactly
    on and just past a block boundary drawn on purpose."""
    B = draw(st.integers(1, sizes.max_seqs))
    layout = []
    for _ in range(B):
        q_len = draw(st.sampled_from([0, 1, sizes.max_query]) | st.integers(0, sizes.max_query))
        kind = draw(st.sampled_from(["any", "on_boundary", "past_boundary"]))
        if kind == "any":
            seq_len = q_len + draw(st.integers(0, sizes.max_context))
        else:
            blocks = draw(st.integers(max(1, -(-q_len // block_size)), max(1, sizes.max_context // block_size)))
            seq_len = blocks * block_size + (kind == "past_boundary")
            seq_len = max(seq_len, q_len)
        layout.append((q_len, seq_len))
    return layout


@st.composite
def attention_cases(draw, sizes: Sizes = CPU_SIZES, dtypes=(torch.float32, torch.float16, torch.bfloat16),
                    cache_dtypes=CACHE_DTYPE_CHOICES, allow_out: bool = True,
                    packings=("plain",), invisible_fills=INVISIBLE_FILLS) -> AttentionCase:
    """One call; the cache rows no query sees hold NaN, +-Inf or the dtype's largest value
    when ``invisible`` is drawn (they must never reach the output). A test that later
    points the batch at other rows draws with ``invisible_fills=(None,)``."""
    device = sizes.device
    block_size = draw(st.sampled_from(sizes.block_sizes))
    layout = draw(seq_layouts(sizes, block_size))
    Hk = draw(st.sampled_from(sizes.kv_heads))
    G = draw(st.sampled_from(sizes.queries_per_kv))
    D = draw(st.sampled_from(sizes.head_dims))
    dtype = draw(st.sampled_from(dtypes))
    cache_choice = draw(st.sampled_from(cache_dtypes))
    cache_dtype = dtype if cache_choice == "same" else cache_choice
    causal = draw(st.booleans())
    window = draw(st.none() | st.integers(1, 2 * block_size + 3))
    sinks_kind = draw(st.sampled_from([None, "normal", "very_negative", "very_positive"]))
    use_out = allow_out and draw(st.booleans())
    scale = draw(st.none() | st.floats(0.05, 0.5))
    memory = draw(st.sampled_from(LAYOUTS))
    packing = draw(st.sampled_from(packings))
    invisible = draw(st.sampled_from(invisible_fills))
    seed = draw(st.integers(0, 2**31 - 1))

    g = make_generator(seed, device)
    B = len(layout)
    q_lens = [q for q, _ in layout]
    seq_lens = [s for _, s in layout]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_seq + [1]) + draw(st.integers(0, 2))
    num_blocks = sum(blocks_per_seq) + draw(st.integers(1, 3))
    # Shuffled physical blocks: neighbours in a sequence are never neighbours in memory.
    perm = torch.randperm(num_blocks, generator=g, device=device)
    block_table = torch.zeros(B, max_blocks, dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_table[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    # Entries past a request's pages are stale: they name blocks no request owns.
    free = perm[used:]
    stale = torch.randint(len(free), (B, max_blocks), generator=g, device=device)
    for b, n in enumerate(blocks_per_seq):
        block_table[b, n:] = free[stale[b, n:]].to(torch.int32)
    T = sum(q_lens)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    k_scale = v_scale = None
    if cache_dtype in FP8_DTYPES:
        k_scale = draw(st.sampled_from([0.25, 0.5, 1.0]))
        v_scale = draw(st.sampled_from([0.25, 0.5, 1.0]))
    query = randn((T, Hk * G, D), g, device, dtype)
    keys, values = randn((num_blocks, block_size, Hk, D), g, device), randn((num_blocks, block_size, Hk, D), g, device)
    if invisible is not None:
        unseen = unseen_rows(block_table, q_lens, seq_lens, block_size, window, num_blocks).to(device)
        keys[unseen] = values[unseen] = fill_value(invisible, cache_dtype)
    key_cache = to_cache_dtype(keys, cache_dtype, k_scale or 1.0)
    value_cache = to_cache_dtype(values, cache_dtype, v_scale or 1.0)
    sinks = None
    if sinks_kind is not None:
        offset = {"normal": 0.0, "very_negative": -30.0, "very_positive": 30.0}[sinks_kind]
        sinks = randn((Hk * G,), g, device) + offset
    kwargs: dict[str, Any] = dict(scale=scale, causal=causal, sliding_window=window, sinks=sinks,
                                  k_scale=k_scale, v_scale=v_scale)
    if use_out:
        kwargs["out"] = relayout(torch.full_like(query, float("nan")), memory)
    if sinks is not None:
        kwargs["sinks"] = relayout(sinks, memory)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    description = (f"B={B} q_lens={q_lens} seq_lens={seq_lens} bs={block_size} Hk={Hk} G={G} D={D} "
                   f"{dtype} cache={cache_dtype} causal={causal} window={window} sinks={sinks_kind} memory={memory} "
                   f"packing={packing} invisible={invisible}")
    args = [relayout(t, memory) for t in (query, key_cache, value_cache, block_table, qsl, seq_lens_t)]
    args[1], args[2] = pack_caches(args[1], args[2], packing)
    return AttentionCase(args=tuple(args),
                         kwargs=kwargs, description=description, q_lens=q_lens, seq_lens=seq_lens)


@dataclass
class PrecomputeCase:
    args: tuple  # (states, positions, weights, key_caches, value_caches, slot_mapping)
    kwargs: dict[str, Any]
    description: str

    @property
    def key_caches(self):
        return self.args[3]

    @property
    def value_caches(self):
        return self.args[4]

    @property
    def slot_mappings(self) -> list[torch.Tensor | None]:
        mapping, L = self.args[5], self.args[2].num_layers
        if mapping is None:
            return [None] * L
        if isinstance(mapping, torch.Tensor):
            return [mapping] * L
        return list(mapping)


def make_weights(g: torch.Generator, device: str, *, L: int, Hk: int, D: int, H: int, R: int,
                 is_neox: bool, bias: bool, v_scale: float | None, dtype: torch.dtype,
                 max_position: int = 4096, per_layer_norm: bool = False, rope_layers: tuple[bool, ...] | None = None,
                 round_k_before_rope: bool = False, weight_format: tuple | None = None) -> ContextKVWeights:
    """Random weights; ``per_layer_norm``: a hidden norm weight per layer (``[L, H]``);
    ``weight_format``: None (rows in ``dtype``) or ``(fp8 dtype, "tensor" or "channel")``:
    the rows quantized with a per-tensor or per-row float32 scale (:func:`quantize_rows`)."""
    kv_weight = randn((L * 2 * Hk * D, H), g, device, dtype, std=H ** -0.5)
    kv_weight_scale = None
    if weight_format is not None:
        kv_weight, kv_weight_scale = quantize_rows(kv_weight.float(), *weight_format)
    return ContextKVWeights(
        hidden_norm_weight=(1 + randn((L, H) if per_layer_norm else (H,), g, device, std=0.2)).to(dtype),
        kv_weight=kv_weight, kv_weight_scale=kv_weight_scale,
        kv_bias=randn((L * 2 * Hk * D,), g, device, dtype, std=0.1) if bias else None,
        k_norm_weight=(1 + randn((L, D), g, device, std=0.3)).to(dtype),
        cos_sin_cache=build_cos_sin_cache(R, max_position, {"rope_theta": 10000.0}).to(device),
        is_neox=is_neox, eps=1e-6, v_scale=v_scale, num_layers=L, num_kv_heads=Hk, head_dim=D,
        rope_layers=rope_layers, round_k_before_rope=round_k_before_rope)


def quantize_rows(rows: torch.Tensor, dtype: torch.dtype, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` as fp8 ``dtype`` codes and their float32 scale (``[1]`` per-tensor, one per
    row per-channel), each scale mapping its rows' largest magnitude to the format's
    largest value, as a checkpoint's quantizer does."""
    amax = rows.abs().amax(dim=1) if granularity == "channel" else rows.abs().amax().view(1)
    scale = (amax.clamp(min=1e-12) / torch.finfo(dtype).max).float()
    limit = torch.finfo(dtype).max
    return (rows / scale.view(-1, 1)).clamp(-limit, limit).to(dtype), scale


WEIGHT_FORMATS = tuple((dtype, granularity) for dtype in FP8_DTYPES for granularity in ("tensor", "channel"))


@st.composite
def precompute_cases(draw, sizes: Sizes = CPU_SIZES, dtypes=(torch.float32, torch.float16, torch.bfloat16),
                     cache_dtypes=CACHE_DTYPE_CHOICES, packings=("plain",), weight_formats=(None,)) -> PrecomputeCase:
    """One call; ``weight_formats``: the K/V rows' formats to draw from (None: rows in the
    states' dtype; see :func:`make_weights`)."""
    device = sizes.device
    N = draw(st.sampled_from([1, sizes.max_tokens]) | st.integers(1, sizes.max_tokens))
    L = draw(st.integers(1, sizes.max_layers))
    Hk = draw(st.sampled_from(sizes.kv_heads))
    D = draw(st.sampled_from(sizes.head_dims))
    H = draw(st.sampled_from(sizes.hidden_sizes))
    R = draw(st.sampled_from(sorted({D, D // 2, 2 * max(1, D // 8)})))  # full, half, partial rotary
    is_neox = draw(st.booleans())
    bias = draw(st.booleans())
    v_scale = draw(st.none() | st.sampled_from([0.5, 2.0]))
    # the DFlash family's variants: per-layer hidden norms (Laguna), NoPE layers (Ricursive),
    # the normed K rounded before RoPE (Beam)
    per_layer_norm = draw(st.booleans())
    rope_layers = draw(st.none() | st.lists(st.booleans(), min_size=L, max_size=L).map(tuple))
    round_k = draw(st.booleans())
    dtype = draw(st.sampled_from(dtypes))
    cache_choice = draw(st.sampled_from(cache_dtypes))
    cache_dtype = dtype if cache_choice == "same" else cache_choice
    block_size = draw(st.sampled_from(sizes.block_sizes))
    mapping_kind = draw(st.sampled_from(["shared", "per_layer", "per_layer_with_none", "none"]))
    return_kv = draw(st.booleans())
    layout = draw(st.sampled_from(LAYOUTS))
    packing = draw(st.sampled_from(packings))
    weight_format = draw(st.sampled_from(weight_formats))
    seed = draw(st.integers(0, 2**31 - 1))

    g = make_generator(seed, device)
    weights = make_weights(g, device, L=L, Hk=Hk, D=D, H=H, R=R, is_neox=is_neox, bias=bias,
                           v_scale=v_scale, dtype=dtype, per_layer_norm=per_layer_norm, rope_layers=rope_layers,
                           round_k_before_rope=round_k, weight_format=weight_format)
    states = randn((N, H), g, device, dtype, std=2.0)
    positions = torch.randint(0, weights.max_position, (N,), generator=g, device=device)
    num_blocks = -(-N // block_size) + 2
    capacity = num_blocks * block_size

    def slots() -> torch.Tensor:
        s = torch.randperm(capacity, generator=g, device=device)[:N]
        skip = torch.rand(N, generator=g, device=device) < 0.25
        return torch.where(skip, torch.full_like(s, -1), s)

    if mapping_kind == "shared":
        slot_mapping: Any = slots()
    elif mapping_kind == "none":
        slot_mapping = None
    else:
        slot_mapping = [slots() for _ in range(L)]
        if mapping_kind == "per_layer_with_none":
            slot_mapping[draw(st.integers(0, L - 1))] = None
    k_scales = v_scales = None
    if cache_dtype in FP8_DTYPES:
        k_scales = [draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in range(L)]
        v_scales = [draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in range(L)]
    key_caches = [to_cache_dtype(randn((num_blocks, block_size, Hk, D), g, device), cache_dtype, 1.0)
                  for _ in range(L)]
    value_caches = [to_cache_dtype(randn((num_blocks, block_size, Hk, D), g, device), cache_dtype, 1.0)
                    for _ in range(L)]
    description = (f"N={N} L={L} Hk={Hk} D={D} H={H} R={R} neox={is_neox} bias={bias} v_scale={v_scale} "
                   f"per_layer_norm={per_layer_norm} rope_layers={rope_layers} round_k={round_k} "
                   f"{dtype} cache={cache_dtype} bs={block_size} mapping={mapping_kind} return_kv={return_kv} "
                   f"layout={layout} packing={packing} weights={weight_format}")
    if isinstance(slot_mapping, list):
        slot_mapping = [None if m is None else relayout(m, layout) for m in slot_mapping]
    elif slot_mapping is not None:
        slot_mapping = relayout(slot_mapping, layout)
    packed = [pack_caches(relayout(k, layout), relayout(v, layout), packing) for k, v in zip(key_caches, value_caches)]
    key_caches, value_caches = [k for k, _ in packed], [v for _, v in packed]
    return PrecomputeCase(args=(relayout(states, layout), relayout(positions, layout), weights, key_caches,
                                value_caches, slot_mapping),
                          kwargs=dict(k_scales=k_scales, v_scales=v_scales, return_kv=return_kv),
                          description=description)


@st.composite
def attention_launch_configs(draw, queries_per_kv: int):
    """Pinned launch configs of the Triton attention kernel, split-KV included."""
    from dflash_rocm.backends.triton.launch_config import MERGES, AttentionLaunchConfig

    block_m = draw(st.sampled_from([m for m in (16, 32, 64) if m >= queries_per_kv]))
    return AttentionLaunchConfig(block_m=block_m, block_n=draw(st.sampled_from([16, 32])),
                                 num_segments=draw(st.sampled_from([1, 2, 4, 8])),
                                 min_segment_keys=draw(st.sampled_from([0, 16, 48])),
                                 merge=draw(st.sampled_from(MERGES)),
                                 merge_rows=draw(st.sampled_from([r for r in (0, 8, 16) if r <= block_m])),
                                 fp16_dots=draw(st.booleans()), fp8_k_at_load=draw(st.booleans()))


@st.composite
def precompute_launch_configs(draw):
    from dflash_rocm.backends.triton.launch_config import PrecomputeLaunchConfig

    split_k = draw(st.sampled_from([1, 2, 3]))
    return PrecomputeLaunchConfig(block_t=draw(st.sampled_from([16, 32, 64])), block_k=draw(st.sampled_from([16, 32])),
                                  split_k=split_k,
                                  whole_tiles=draw(st.sampled_from([0, 1, 5])),  # then the rest split
                                  num_xcds=draw(st.sampled_from([1, 3, 8])),
                                  square_group=draw(st.sampled_from([1, 8])),
                                  heads=draw(st.sampled_from([1, 2])) if split_k == 1 else 1)


NUMPY_TYPES = {int: (np.int32, np.int64), float: (np.float32, np.float64)}


@st.composite
def numpy_scalars(draw, value):
    """``value`` with every Python int and float in it (a list or tuple's too) as a numpy
    scalar that holds it: what a caller computing with numpy passes. Anything else is
    returned as it is."""
    if isinstance(value, (list, tuple)):
        return type(value)(draw(numpy_scalars(v)) for v in value)
    if type(value) in NUMPY_TYPES:
        return draw(st.sampled_from(NUMPY_TYPES[type(value)]))(value)
    return value


@st.composite
def with_numpy_scalars(draw, case):
    """An :class:`AttentionCase` or :class:`PrecomputeCase` whose scalar arguments (scale,
    window, fp8 scales; the weights' eps and value scale) are numpy scalars."""
    kwargs = {k: draw(numpy_scalars(v)) if k in ("scale", "sliding_window", "k_scale", "v_scale", "k_scales",
                                                    "v_scales") else v for k, v in case.kwargs.items()}
    args = case.args
    if isinstance(case, PrecomputeCase):
        w = args[2]
        weights = dataclasses.replace(w, eps=draw(numpy_scalars(w.eps)), v_scale=draw(numpy_scalars(w.v_scale)))
        args = (*args[:2], weights, *args[3:])
    return dataclasses.replace(case, args=args, kwargs=kwargs)


@dataclass(frozen=True)
class ScaleForm:
    """One way callers pass ``n`` fp8 scales: ``floats`` (a float, or a list of them),
    ``tensor`` (one float tensor of ``n``), ``tensors`` (a list or tuple of one-element
    tensors, 0-d or ``[1]``: vLLM's per-layer ``_k_scale``). :meth:`update` gives the next
    call's scales as a caller would: tensors written in place, floats anew."""

    kind: str
    container: type = list
    dtype: torch.dtype = torch.float32
    shape: tuple = (1,)

    def make(self, values: list[float], device: str):
        if self.kind == "floats":
            if self.container is float:
                return values[0] if len(values) == 1 else list(values)
            return self.container(values)
        if self.kind == "tensor":
            return torch.tensor(values, dtype=self.dtype, device=device)
        return self.container(torch.full(self.shape, v, dtype=self.dtype, device=device) for v in values)

    def update(self, arg, values: list[float]):
        if self.kind == "floats":
            return self.make(values, "cpu")
        if self.kind == "tensor":
            arg.copy_(torch.tensor(values, dtype=arg.dtype))
            return arg
        for t, v in zip(arg, values):
            t.fill_(v)
        return arg


@st.composite
def scale_forms(draw, kinds=("floats", "tensor", "tensors")):
    kind = draw(st.sampled_from(kinds))
    containers = [float, list, tuple] if kind == "floats" else [list, tuple]
    return ScaleForm(kind, draw(st.sampled_from(containers)), draw(st.sampled_from([torch.float32, torch.float64])),
                     draw(st.sampled_from([(), (1,)])))


OVERLAPS = ("one_storage", "numpy", "frombuffer")


@st.composite
def overlapping(draw, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous copies of ``first`` and ``second`` (CPU; shapes, dtypes, values kept) in
    memory that overlaps by at least one byte: views of one storage, or two storages over
    one buffer (views of a numpy array, ``torch.frombuffer``), which comparing storages
    cannot see. The second starts a multiple of 16 bytes from the first, either side."""
    kind = draw(st.sampled_from(OVERLAPS))
    na, nb = first.nbytes, second.nbytes
    d = 16 * draw(st.integers(-((nb - 1) // 16), (na - 1) // 16))  # second's start from first's, in bytes
    low = min(0, d)
    buffer = np.zeros(max(na, d + nb) - low, dtype=np.uint8)
    shared = torch.from_numpy(buffer)

    def place(t: torch.Tensor, at: int) -> torch.Tensor:
        if kind == "one_storage":
            raw = shared[at:at + t.nbytes]
        elif kind == "numpy":
            raw = torch.from_numpy(buffer[at:at + t.nbytes])
        else:
            raw = torch.frombuffer(memoryview(buffer)[at:at + t.nbytes], dtype=torch.uint8)
        view = raw.view(t.dtype).view(t.shape)
        view.copy_(t)
        return view

    a = place(first, -low)
    b = place(second, d - low)
    a.copy_(first)  # the second copy may have overwritten part of the first
    return a, b


PLAN_COPIES = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda plan: pickle.loads(pickle.dumps(plan))}


def plan_copies():
    """Ways a caller may copy a plan (each refused: plans are bound to their tensors' memory)."""
    return st.sampled_from(sorted(PLAN_COPIES)).map(PLAN_COPIES.get)
