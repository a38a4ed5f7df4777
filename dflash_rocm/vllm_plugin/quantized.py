"""Dense K/V rows of a quantized ``qkv_proj``, read at the plugin's read point.

Right after the draft's ``load_weights`` every vLLM quantization method still holds its
checkpoint layout (no fnuz conversion, transpose, padding, shuffle, Marlin/ExLlama repack
or oneDNN prepack yet: those come in ``process_weights_after_loading``), so the dense
weight is a closed form of the layer's tensors per method. Each is computed in float64,
exactly (a code of at most 8 bits times a float32 scale fits float64's 53 bits), and
rounded once, to the draft's dtype, by the caller.

Methods, by the tensors the layer holds (``W[n, k]``, ``n`` an output row of this rank):

- fp8 (``weight`` e4m3/e5m2 ``[N, K]``): ``W = w * s`` with ``weight_scale`` per shard
  (``[shards]``; a checkpoint with one fused ``qkv`` scale leaves ``s[1:]`` at vLLM's
  initial ``float32`` minimum: ``s[0]`` is the scale), per channel ``[N, 1]``, or per
  ``[bn, bk]`` block (``weight_scale_inv`` or ``weight_scale`` ``[N/bn, K/bk]``).
- int8 (``weight`` int8 + ``weight_scale``, per tensor or per channel): the same. Its zero
  point (``input_zero_point``) belongs to the activations, not the weight, so the dense
  weight does not use it.
- MXFP8 (fp8 ``weight`` + uint8 e8m0 ``weight_scale`` per 32 inputs): ``w * 2^(e - 127)``.
- MXFP4 (``weight``/``weight_packed`` uint8 ``[N, K/2]``, two e2m1 codes a byte, low
  nibble first, + e8m0 scales per 32): ``e2m1 * 2^(e - 127)``.
- NVFP4 (the same e2m1 bytes, low nibble first, + e4m3 ``weight_scale`` per 16 inputs +
  one float32 global scale per shard): ModelOpt ``e2m1 * s * weight_scale_2``,
  compressed-tensors ``nvfp4-pack-quantized`` ``e2m1 * s / weight_global_scale`` (it stores
  the divisor), as vLLM 0.34's ``dequantize_to_dtype`` and its loaders' post-load steps
  read them. Each shard's own global scale: vLLM's kernels take the largest of the shards'
  (and warn where they differ); a checkpoint's fused ``qkv_proj`` fills every slot with its one.
- compressed-tensors wNa16 (``weight_packed`` int32 ``[N, K*b/32]`` packed along K,
  ``weight_scale [N, G]``): symmetric ``(q - 2^(b-1)) * s``; asymmetric
  ``(q - z) * s`` with ``weight_zero_point [N*b/32, G]`` packed along N.
- GPTQ (``qweight [K*b/32, N]`` packed along K, ``scales [G, N]``, ``g_idx``):
  symmetric only, as vLLM serves it, ``(q - 2^(b-1)) * s[g(k)]``. Packed ints of a method
  named neither GPTQ nor AWQ (Intel Neural Compressor's AutoRound schemes) step aside.
- AWQ (``qweight [K, N*b/32]`` packed along N in the order ``[0,4,1,5,2,6,3,7]``,
  ``qzeros`` likewise, ``scales [G, N]``): ``(q - z) * s`` (``z = 2^(b-1)`` without zero points).
- Quark W4A16 (``weight [K, N/8]`` int32 packed along N, in AWQ order when the export
  reorders, ``weight_scale [G, N]``, ``weight_zero_point``): symmetric codes are signed
  nibbles, asymmetric ``(q - z) * s``.

fp8 rows with a per-tensor or per-channel scale can also be kept as they are, where the
backend serving the precompute reads fp8 rows (:func:`fp8_rows`): half the bytes of dense
bf16 rows, and no dense copy held.

A method none of these covers steps aside with its name (the generic probe
``quant_method.apply(layer, c * I)`` works only after vLLM's post-load processing, past
this read point, and needs ``c`` representable under static input scales: not used).
"""

from __future__ import annotations

import torch

from ..contract import FP8_DTYPES

FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble slot that holds column i of a packed group
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MX_BLOCK = 32
NVFP4_BLOCK = 16
# Parameters of a quantized qkv_proj that carry its weight (a reload streams them).
WEIGHT_TENSORS = ("weight", "weight_scale", "weight_scale_inv", "weight_packed", "qweight", "scales", "qzeros",
                  "weight_zero_point", "g_idx", "weight_scale_2", "weight_global_scale")
# Parameters holding one scale per shard (``[shards]``) when they have no output dimension.
PER_SHARD_SCALES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "weight_global_scale")


_FP8 = "dequantized: fp8 x per-shard, per-channel or block scales"
_GPTQ = "dequantized: packed ints, symmetric (asymmetric steps aside)"
_AWQ = "dequantized: AWQ-order packed ints, zero points, group scales"
_MXFP8 = "dequantized: fp8 x 2^(e8m0-127) per 32 inputs"
_NVFP4 = "dequantized: e2m1 x e4m3 scales per 16 inputs x the shard's global scale"
_PLAIN = "plain rows: its linear layers stay unquantized (it quantizes MoE experts only)"
# vLLM quantization config name -> how the plugin serves a draft's K/V rows under it. The
# plugin decides by the tensors a layer holds (:func:`reader`), so this is the summary
# ``dflash-rocm info`` shows: what each method gives a draft's qkv_proj in vLLM 0.32-0.34.
SERVED = {
    "fp8": _FP8, "fbgemm_fp8": _FP8, "fp8_per_tensor": _FP8, "fp8_per_channel": _FP8, "fp8_per_block": _FP8,
    "deepseek_v4_fp8": _FP8 + " (its linear layers are Fp8Config's)",
    "w4afp8": _FP8 + " (its linear layers are Fp8Config's; the 4-bit weights are MoE experts')",
    "online": "dequantized: the checkpoint's dense weight, or fp8 x scales once quantized",
    "int8_per_channel_weight_only": "dequantized: int8 x per-channel scales (vLLM 0.34: " + _PLAIN + ")",
    "compressed-tensors": "dequantized: fp8/int8 x scales, wNa16 packed ints (sym/asym), MXFP4, MXFP8, NVFP4 "
                          "(nvfp4-pack-quantized); other schemes step aside",
    "quark": "dequantized: fp8/int8 x scales, W4A16 int4, MXFP4/MXFP8; other schemes step aside",
    "modelopt": "dequantized where its weights are fp8 x scales; other formats step aside",
    "modelopt_fp4": _NVFP4,
    "modelopt_mixed": "dequantized per layer: fp8 x scales, NVFP4, MXFP8; other formats step aside",
    "modelopt_mxfp8": _MXFP8, "mxfp8": _MXFP8,
    "gptq": _GPTQ, "auto_gptq": _GPTQ, "gptq_marlin": _GPTQ, "awq": _AWQ, "auto_awq": _AWQ, "awq_marlin": _AWQ,
    "moe_wna16": "dequantized: its linear layers are GPTQ's (symmetric) or AWQ's",
    "experts_int8": _PLAIN, "nvfp4_per_token": _PLAIN, "lut_b_moe": _PLAIN,
    "mxfp4": _PLAIN + "; as an online --quantization (quantized while loading) its rows are read as MXFP4 "
                      "codes and scales (not checked here)",
    "gpt_oss_mxfp4": _PLAIN,
}
# The methods whose K/V rows the plugin does not read, and why: vLLM's per-layer path serves them.
STEPS_ASIDE = {
    "torchao": "steps aside: its weights are torchao tensor subclasses, no closed form read here",
    "humming": "steps aside: Humming's own packed layouts, no closed form read here",
    "inc": "fp8, MXFP4 and MXFP8 schemes dequantized; its wNa16 (AutoRound) packed ints step aside "
           "(their packing and zero points are not GPTQ's as the plugin reads it)",
    "mxfp4_hadamard32": "steps aside: its weights are Hadamard-rotated and quantized while loading "
                        "(InputHadamardLinearMethod): the rows at the read point are rotated",
    "fp_quant": "steps aside: FP-Quant's Hadamard-rotated packed layouts, no closed form read here",
}
_UNKNOWN = "steps aside (no closed form here): vLLM's per-layer path serves"


def support(methods) -> list[tuple[str, str]]:
    """``(method, how the plugin serves a draft's K/V under it)`` for vLLM's quantization
    config names ``methods`` (``QUANTIZATION_METHODS``): served, or why it steps aside."""
    return [(m, SERVED.get(m) or STEPS_ASIDE.get(m, _UNKNOWN)) for m in methods]


# --- closed forms on checkpoint tensors (output rows first unless said) ---------------------------------

def scaled(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """``codes * scale`` in float64: ``scale`` a scalar, one per row (``[N]``/``[N, 1]``),
    or one per ``block`` of ``[bn, bk]`` (``[ceil(N/bn), ceil(K/bk)]``)."""
    w, s = codes.double(), scale.double()
    if block is not None:
        bn, bk = block
        s = s.repeat_interleave(bn, 0)[:w.shape[0]].repeat_interleave(bk, 1)[:, :w.shape[1]]
    elif s.numel() > 1:
        s = s.reshape(-1, 1)
    return w * s


def per_input(scale: torch.Tensor, width: int, group: int) -> torch.Tensor:
    """Scales ``[N, ceil(K/group)]``, each repeated over its ``group`` inputs (``width`` K)."""
    return scale.repeat_interleave(group, 1)[:, :width]


def e8m0(exponents: torch.Tensor, width: int) -> torch.Tensor:
    """MX scales ``2^(e - 127)`` (uint8 ``[N, K/32]``, or a streamed ``float8_e8m0fnu``
    tensor read as its bits), each repeated over its 32 inputs (``width`` K)."""
    bits = exponents.view(torch.uint8) if exponents.dtype == getattr(torch, "float8_e8m0fnu", None) else exponents
    return per_input(torch.exp2(bits.to(torch.int32).double() - 127), width, MX_BLOCK)


def e2m1(packed: torch.Tensor) -> torch.Tensor:
    """FP4 e2m1 codes, two a byte (low nibble first), ``[N, K/2]`` uint8 -> float64 ``[N, K]``."""
    b = packed.to(torch.int32)
    nibbles = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], -1)
    values = torch.tensor(E2M1, dtype=torch.float64, device=b.device)[nibbles & 0x7]
    return torch.where(nibbles >= 8, -values, values)


def unpack(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned ``bits``-wide codes of int32 words packed along ``dim`` (value ``i`` of a
    word in bit slot ``order[i]``; natural order when None), as int32."""
    per = 32 // bits
    slots = torch.tensor(order if order is not None else range(per), dtype=torch.int32, device=packed.device)
    words = packed.to(torch.int32).movedim(dim, -1)
    codes = (words.unsqueeze(-1) >> (slots * bits)) & ((1 << bits) - 1)
    return codes.reshape(*words.shape[:-1], -1).movedim(-1, dim)


def grouped(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | int, groups: torch.Tensor) -> torch.Tensor:
    """``(q - z) * s`` for codes ``[N, K]`` whose input ``k`` is in group ``groups[k]``
    (``scale``/``zero`` ``[N, G]``, or ``zero`` one integer offset)."""
    s = scale.double()[:, groups]
    z = zero[:, groups].double() if isinstance(zero, torch.Tensor) else float(zero)
    return (codes.double() - z) * s


def _groups(width: int, group: int, device) -> torch.Tensor:
    return torch.arange(width, device=device) // group


# --- fp8 rows kept as they are ----------------------------------------------------------------------------

def fp8_rows(tensors: dict, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A shard's fp8 codes ``[rows, K]`` and float32 scale per row ``[rows]`` when its
    tensors (:func:`shard_tensors`) are e4m3 codes with one scale for the shard or one per
    row (None: block or MX scales, int8, packed ints: dequantized instead)."""
    weight, scale = tensors.get("weight"), tensors.get("weight_scale")
    if (weight is None or scale is None or "weight_scale_inv" in tensors or weight.dtype not in FP8_DTYPES
            or not scale.is_floating_point() or weight.dim() != 2 or weight.shape[0] != rows):
        return None
    if scale.numel() == 1:
        return weight, scale.float().reshape(1).expand(rows)
    if scale.numel() == rows and (scale.dim() == 1 or scale.shape[-1] == 1):
        return weight, scale.float().reshape(rows)
    return None


def as_fnuz(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn codes as the e4m3fnuz codes of the same values (MI300's format): the same bits
    are worth half in fnuz, so the scale doubles; fn's -0 (0x80, NaN in fnuz) becomes 0."""
    if codes.dtype == torch.float8_e4m3fnuz:
        return codes, scale
    bits = codes.view(torch.uint8).clone()
    bits[bits == 0x80] = 0
    return bits.view(torch.float8_e4m3fnuz), scale * 2


# --- the layer's method, read from its tensors -----------------------------------------------------------

def describe(linear) -> str:
    """The method's name as vLLM calls it (its scheme's class, else its method's)."""
    scheme = getattr(linear, "scheme", None)
    return type(scheme if scheme is not None else linear.quant_method).__name__


def output_dims(linear) -> dict[str, int | None]:
    """Each weight-carrying parameter's ``output_dim`` (None: a per-tensor or input-only
    tensor), read at the read point: post-load processing may replace the parameters."""
    return {name: getattr(p, "output_dim", None) for name, p in linear.named_parameters(recurse=False)
            if name in WEIGHT_TENSORS}


def shard_tensors(linear, start: int, stop: int, tensors: dict | None = None,
                  dims: dict[str, int | None] | None = None) -> dict[str, torch.Tensor] | str:
    """The checkpoint-layout tensors of output rows ``[start, stop)`` of this rank's
    ``linear`` (one shard's, K or V), taken from its parameters or from ``tensors`` (a
    reload's whole-``qkv_proj`` tensors by parameter name, laid out as the parameters):
    each weight-carrying tensor narrowed along its parameter's ``output_dim`` in proportion
    (packed words, scale blocks), a per-shard scale reduced to that shard's (``s[0]`` where
    a fused checkpoint left it at vLLM's initial minimum), input-only tensors (``g_idx``)
    whole; copies. ``dims``: :func:`output_dims` as read earlier (default: now). Or why not."""
    rows = int(getattr(linear, "output_size_per_partition", 0) or sum(linear.output_partition_sizes))
    dims = output_dims(linear) if dims is None else dims
    out = {}
    for name, dim in dims.items():
        if tensors is not None and name not in tensors:
            continue
        data = getattr(linear, name).detach() if tensors is None else tensors[name]
        if dim is None and name in PER_SHARD_SCALES and data.numel() > 1:
            out[name] = _shard_scale(linear, data, start).reshape(1)
            continue
        if dim is None:
            out[name] = data.clone()
            continue
        lo, hi = start * data.shape[dim], stop * data.shape[dim]
        if lo % rows or hi % rows:
            return f"{name} packs the K/V rows [{start}, {stop}) with others"
        out[name] = data.narrow(dim, lo // rows, (hi - lo) // rows).clone()
    return out


def _shard_scale(linear, scale: torch.Tensor, row: int) -> torch.Tensor:
    s = scale.detach().double().reshape(-1)
    widths = list(getattr(linear, "logical_widths", None) or linear.output_partition_sizes)
    if s.numel() != len(widths):
        raise ValueError(f"{s.numel()} per-tensor scales for {len(widths)} shards")
    index = sum(1 for end in torch.tensor(widths).cumsum(0).tolist() if end <= row)
    picked = s[index]
    return s[0] if picked == torch.finfo(torch.float32).min else picked


def reader(linear):
    """``read(tensors) -> float64 [rows, K]`` for ``linear``'s method (from a shard's
    :func:`shard_tensors`), or why no closed form serves it."""
    params = dict(linear.named_parameters(recurse=False))
    weight = params.get("weight")
    scale = params.get("weight_scale", params.get("weight_scale_inv"))
    name = describe(linear)
    config = getattr(linear.quant_method, "quant_config", None)
    scheme = getattr(linear, "scheme", None)
    if "Hadamard" in name:
        return f"{name} rotates its weights and inputs by a Hadamard matrix: its rows at the read point are rotated"
    if "qweight" in params:
        if "AWQ" in name.upper():
            return lambda t: _awq(t, config)
        if "GPTQ" not in name.upper():
            return f"packed ints of {name}, neither GPTQ's nor AWQ's layout as the plugin reads them"
        if getattr(config, "is_sym", True) is False:
            return "asymmetric GPTQ (vLLM serves GPTQ symmetric only)"
        return lambda t: _gptq(t, config)
    if "weight_packed" in params and params["weight_packed"].dtype == torch.int32:
        return lambda t: _wna16(t, scheme)
    packed4 = params.get("weight_packed", weight)
    if packed4 is not None and packed4.dtype == torch.uint8 and scale is not None:
        if scale.dtype == torch.uint8:
            return _mxfp4
        if scale.dtype == torch.float8_e4m3fn and ("weight_scale_2" in params or "weight_global_scale" in params):
            return _nvfp4
    if weight is not None and scale is not None:
        if weight.dtype in FP8_WEIGHT_DTYPES and scale.dtype == torch.uint8:
            return _mxfp8
        if weight.dtype in FP8_WEIGHT_DTYPES or weight.dtype == torch.int8:
            block = getattr(linear, "weight_block_size", None) or getattr(config, "weight_block_size", None)
            return lambda t: _scaled(t, block)
        if weight.dtype == torch.int32 and scheme is not None and hasattr(scheme, "pack_reorder"):
            return lambda t: _quark_int4(t, scheme)
    if weight is not None and weight.is_floating_point() and "Online" in name and len(params) <= 2:
        return lambda t: t["weight"].double()  # online quantization happens after the read point
    return f"no closed form for {name} (weight {None if weight is None else weight.dtype})"


def _scaled(t, block):
    scale = t.get("weight_scale_inv", t.get("weight_scale"))
    if block is not None and scale.dim() == 2 and scale.shape[1] > 1:
        return scaled(t["weight"], scale, tuple(int(b) for b in block))
    return scaled(t["weight"], scale)


def _mxfp8(t):
    return t["weight"].double() * e8m0(t["weight_scale"], t["weight"].shape[1])


def _mxfp4(t):
    codes = e2m1(t.get("weight_packed", t.get("weight")))
    return codes * e8m0(t["weight_scale"], codes.shape[1])


def _nvfp4(t):
    codes = e2m1(t.get("weight_packed", t.get("weight")))
    blocks = codes * per_input(t["weight_scale"].double(), codes.shape[1], NVFP4_BLOCK)  # exact: 2 x 4 bits
    if "weight_scale_2" in t:  # ModelOpt: the global scale multiplies
        return blocks * t["weight_scale_2"].double()
    return blocks / t["weight_global_scale"].double()  # compressed-tensors stores the divisor


def _wna16(t, scheme):
    bits = int(scheme.num_bits)
    codes = unpack(t["weight_packed"], bits, 1)
    scale = t["weight_scale"]
    groups = _groups(codes.shape[1], -(-codes.shape[1] // scale.shape[1]), codes.device)
    if scheme.symmetric:
        return grouped(codes, scale, 1 << (bits - 1), groups)
    return grouped(codes, scale, unpack(t["weight_zero_point"], bits, 0), groups)


def _gptq(t, config):
    bits = int(getattr(config, "weight_bits", 4))
    codes = unpack(t["qweight"], bits, 0).T  # [N, K]
    scale = t["scales"].T
    g_idx = t.get("g_idx")
    groups = g_idx.long() if g_idx is not None and g_idx.numel() == codes.shape[1] else _groups(
        codes.shape[1], codes.shape[1] // scale.shape[1], codes.device)
    return grouped(codes, scale, 1 << (bits - 1), groups)


def _awq(t, config):
    bits = int(getattr(config, "weight_bits", 4))
    codes = unpack(t["qweight"], bits, 1, AWQ_ORDER).T
    scale = t["scales"].T
    groups = _groups(codes.shape[1], codes.shape[1] // scale.shape[1], codes.device)
    zero: torch.Tensor | int = 1 << (bits - 1)
    if getattr(config, "zero_point", True):
        zero = unpack(t["qzeros"], bits, 1, AWQ_ORDER).T
    return grouped(codes, scale, zero, groups)


def _quark_int4(t, scheme):
    order = AWQ_ORDER if scheme.pack_reorder else None
    codes = unpack(t["weight"], 4, 1, order).T
    scale = t["weight_scale"].T
    groups = _groups(codes.shape[1], codes.shape[1] // scale.shape[1], codes.device)
    if scheme.is_symmetric:
        return grouped(codes ^ 0x8, scale, 8, groups)  # signed nibbles
    return grouped(codes, scale, unpack(t["weight_zero_point"], 4, 1, order).T, groups)
