"""``ContextKVWeights``: the draft-model tensors the fused context-KV precompute needs."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Sequence

import torch

from .contract import FP8_DTYPES, QUERY_DTYPES, dtype_name

# Folded K/V rows are kept within float16's largest value (ContextKVWeights.folded_kv_weight).
FOLD_ROW_LIMIT = 65504.0


@dataclass(frozen=True, eq=False, kw_only=True)
class ContextKVWeights:
    """K/V projection, norms and RoPE table of every draft layer (SPEC.md section 2).

    ``kv_weight`` is layer-major: for layer ``l`` the ``Hk*D`` K rows, then the
    ``Hk*D`` V rows (the K/V rows of each layer's ``qkv_proj``, stacked). Backends derive
    their own layouts from these tensors and rebuild them when a tensor changes in place
    (:mod:`dflash_rocm.derived`). Load one from a checkpoint with
    :func:`dflash_rocm.load_context_kv_weights`.

    The variants of vLLM's DFlash family are data, not other kernels:

    - ``hidden_norm_weight`` is ``[H]`` (one norm before the fused GEMM) or ``[L, H]``
      (each layer normalises the states with its own weight, as Laguna's drafts do). The
      RMS statistic is shared, so a backend may fold row ``l`` into layer ``l``'s K/V rows
      (:meth:`folded_kv_weight`). A Gemma-style norm ``x * (1 + w)`` is this norm with the
      weight ``1 + w``.
    - ``rope_layers``: per layer, whether its K is rotated (None: every layer). Layers
      listed in a Ricursive draft's ``no_rope_layers`` are False: their K stays un-rotated.
    - ``round_k_before_rope``: the normed K is rounded to the states' dtype before RoPE
      (DFlash2 Beam's precompute rounds there).

    Quantized K/V rows: ``kv_weight`` may be fp8 (``float8_e4m3fn``, or
    ``float8_e4m3fnuz`` as MI300 stores it) with a float32 ``kv_weight_scale``, one scale
    for every row (shape ``[]`` or ``[1]``, per-tensor) or one per row
    (``[L*2*Hk*D]``, per-channel); the effective weight is ``kv_weight.float() * scale``
    per row (SPEC.md section 2). The scale is given iff the rows are fp8. The states'
    dtype is then free (float16/bfloat16/float32) instead of ``kv_weight``'s
    (:meth:`accepts_states`), and a backend that reads the fp8 rows applies the scale to
    its float32 accumulator; the other tensors stay float.
    """

    hidden_norm_weight: torch.Tensor
    kv_weight: torch.Tensor
    k_norm_weight: torch.Tensor
    cos_sin_cache: torch.Tensor
    is_neox: bool
    eps: float
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_bias: torch.Tensor | None = None
    v_scale: float | None = None
    rope_layers: tuple[bool, ...] | None = None
    round_k_before_rope: bool = False
    kv_weight_scale: torch.Tensor | None = None
    # every tensor's shape as built: in-place updates may change values only (check_shapes)
    built_shapes: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Checks every field, and keeps its scalars as Python numbers (numpy scalars are
        accepted: kernels take a numpy scalar argument as a tensor)."""
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"ContextKVWeights.{name}: expected a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        L, Hk, D = self.num_layers, self.num_kv_heads, self.head_dim
        tensors = {"hidden_norm_weight": self.hidden_norm_weight, "kv_weight": self.kv_weight,
                   "k_norm_weight": self.k_norm_weight, "cos_sin_cache": self.cos_sin_cache}
        if self.kv_bias is not None:
            tensors["kv_bias"] = self.kv_bias
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"ContextKVWeights.{name}: expected a torch.Tensor, got {type(t).__name__}")
            if name == "kv_weight" and t.dtype in FP8_DTYPES:
                continue  # quantized rows: their scale is checked below
            if t.dtype not in QUERY_DTYPES:
                raise TypeError(f"ContextKVWeights.{name}: expected float16/bfloat16/float32, got {t.dtype}")
            if t.device != self.kv_weight.device:
                raise ValueError(f"ContextKVWeights.{name}: on {t.device}, kv_weight on {self.kv_weight.device}")
        if self.kv_weight.dim() != 2 or self.kv_weight.shape[0] != L * 2 * Hk * D:
            raise ValueError(
                f"ContextKVWeights.kv_weight: expected [num_layers*2*num_kv_heads*head_dim, hidden] = "
                f"[{L * 2 * Hk * D}, H], got {tuple(self.kv_weight.shape)}")
        self._check_weight_scale()
        H = self.kv_weight.shape[1]
        if self.hidden_norm_weight.dim() == 2:
            _expect_shape("hidden_norm_weight", self.hidden_norm_weight, (L, H), "[num_layers, hidden]")
        else:
            _expect_shape("hidden_norm_weight", self.hidden_norm_weight, (H,), "[hidden] or [num_layers, hidden]")
        _expect_shape("k_norm_weight", self.k_norm_weight, (L, D), "[num_layers, head_dim]")
        if self.kv_bias is not None:
            _expect_shape("kv_bias", self.kv_bias, (L * 2 * Hk * D,), "[num_layers*2*num_kv_heads*head_dim]")
        cs = self.cos_sin_cache
        if cs.dim() != 2 or cs.shape[1] % 2 or not 2 <= cs.shape[1] <= D or cs.shape[0] < 1:
            raise ValueError(
                f"ContextKVWeights.cos_sin_cache: expected [max_position, R] with R even and "
                f"2 <= R <= head_dim={D}, got {tuple(cs.shape)}")
        if not isinstance(self.is_neox, bool):
            raise TypeError(f"ContextKVWeights.is_neox: expected bool, got {type(self.is_neox).__name__}")
        if not _is_real(self.eps) or not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"ContextKVWeights.eps: expected a positive finite float, got {self.eps!r}")
        object.__setattr__(self, "eps", float(self.eps))
        if self.v_scale is not None:
            if not _is_real(self.v_scale):
                raise TypeError(f"ContextKVWeights.v_scale: expected a float or None, got {self.v_scale!r}")
            if not math.isfinite(self.v_scale):
                raise ValueError(f"ContextKVWeights.v_scale: expected a finite float, got {self.v_scale!r}")
            object.__setattr__(self, "v_scale", float(self.v_scale))
        if self.rope_layers is not None:
            if not isinstance(self.rope_layers, (tuple, list)) or not all(
                    isinstance(r, bool) for r in self.rope_layers):
                raise TypeError(f"ContextKVWeights.rope_layers: expected None or a sequence of num_layers={L} "
                                f"bools, got {self.rope_layers!r}")
            if len(self.rope_layers) != L:
                raise ValueError(f"ContextKVWeights.rope_layers: expected num_layers={L} entries, got "
                                 f"{len(self.rope_layers)}")
            object.__setattr__(self, "rope_layers", tuple(self.rope_layers))
        if not isinstance(self.round_k_before_rope, bool):
            raise TypeError(f"ContextKVWeights.round_k_before_rope: expected bool, got "
                            f"{type(self.round_k_before_rope).__name__}")
        object.__setattr__(self, "built_shapes", self._shapes())

    def _shapes(self) -> tuple:
        return tuple([None if t is None else t.shape for t in (self.hidden_norm_weight, self.kv_weight,
                                                                self.k_norm_weight, self.cos_sin_cache, self.kv_bias,
                                                                self.kv_weight_scale)])

    def check_shapes(self) -> None:
        """Refuse (``ValueError``, naming the tensor) weights whose tensors were resized in
        place after they were built: every check and every backend's derived layout read
        the shapes they were built with. Updates in place may change values only; build new
        weights for new shapes."""
        if self._shapes() == self.built_shapes:
            return
        names = ("hidden_norm_weight", "kv_weight", "k_norm_weight", "cos_sin_cache", "kv_bias", "kv_weight_scale")
        for name, now, built in zip(names, self._shapes(), self.built_shapes):
            if now != built:
                raise ValueError(f"ContextKVWeights.{name}: resized in place to {list(now)} after these weights were "
                                 f"built with {list(built)}; in-place updates may change values only (build new "
                                 "ContextKVWeights for new shapes)")

    def _check_weight_scale(self) -> None:
        """``kv_weight_scale``: given iff ``kv_weight`` is fp8; float32, per-tensor (``[]``
        or ``[1]``) or per-channel (``[L*2*Hk*D]``), on ``kv_weight``'s device, every value
        finite and positive (read once here: a zero, negative or NaN scale would write
        wrong K/V silently)."""
        s, fp8 = self.kv_weight_scale, self.kv_weight.dtype in FP8_DTYPES
        if s is None:
            if fp8:
                raise ValueError(f"ContextKVWeights.kv_weight_scale: kv_weight is {dtype_name(self.kv_weight.dtype)}: "
                                 "expected a float32 scale, per-tensor [1] or per-channel [num_layers*2*num_kv_heads"
                                 "*head_dim]")
            return
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"ContextKVWeights.kv_weight_scale: expected a torch.Tensor or None, got "
                            f"{type(s).__name__}")
        if not fp8:
            raise TypeError(f"ContextKVWeights.kv_weight_scale: given for a {dtype_name(self.kv_weight.dtype)} "
                            f"kv_weight; scales go with fp8 rows ({', '.join(map(dtype_name, FP8_DTYPES))})")
        if s.dtype != torch.float32:
            raise TypeError(f"ContextKVWeights.kv_weight_scale: expected float32, got {dtype_name(s.dtype)}")
        rows = self.kv_weight.shape[0]
        if s.dim() > 1 or s.numel() not in (1, rows):
            raise ValueError(f"ContextKVWeights.kv_weight_scale: expected [] or [1] (per-tensor) or "
                             f"[num_layers*2*num_kv_heads*head_dim] = [{rows}] (per-channel), got {tuple(s.shape)}")
        if s.device != self.kv_weight.device:
            raise ValueError(f"ContextKVWeights.kv_weight_scale: on {s.device}, kv_weight on {self.kv_weight.device}")
        if s.device.type != "meta" and not bool((torch.isfinite(s) & (s > 0)).all()):  # meta: shapes only
            raise ValueError(f"ContextKVWeights.kv_weight_scale: expected finite positive scales, got "
                             f"{s.detach().flatten()[:8].tolist()}")

    @property
    def quantized(self) -> bool:
        """Whether ``kv_weight`` holds fp8 rows with ``kv_weight_scale``."""
        return self.kv_weight_scale is not None

    def row_scales(self) -> torch.Tensor:
        """float32 ``[L*2*Hk*D]``: each K/V row's weight scale (ones for float rows)."""
        rows = self.kv_weight.shape[0]
        if self.kv_weight_scale is None:
            return torch.ones(rows, dtype=torch.float32, device=self.device)
        return self.kv_weight_scale.detach().reshape(-1).expand(rows)

    def dense_kv_weight(self) -> torch.Tensor:
        """The effective K/V rows: ``kv_weight`` itself, or the fp8 rows dequantized in
        float32 (``kv_weight.float() * scale`` per row: exact, fp8 times a float32 scale)."""
        if self.kv_weight_scale is None:
            return self.kv_weight
        return self.kv_weight.float() * self.row_scales()[:, None]

    def accepts_states(self, dtype: torch.dtype) -> bool:
        """Whether context states of ``dtype`` go with these weights: ``kv_weight``'s dtype
        for float rows; any of float16/bfloat16/float32 for fp8 rows."""
        return dtype in QUERY_DTYPES if self.quantized else dtype == self.kv_weight.dtype

    # Shapes the kernels and validation read.
    @property
    def hidden_size(self) -> int:
        return self.kv_weight.shape[1]

    @property
    def rotary_dim(self) -> int:
        return self.cos_sin_cache.shape[1]

    @property
    def max_position(self) -> int:
        return self.cos_sin_cache.shape[0]

    @property
    def per_layer_hidden_norm(self) -> bool:
        """Whether each layer normalises the states with its own ``hidden_norm_weight`` row."""
        return self.hidden_norm_weight.dim() == 2

    @property
    def nope_layers(self) -> tuple[int, ...]:
        """The layers whose K is not rotated (``rope_layers[l]`` False)."""
        return () if self.rope_layers is None else tuple(i for i, r in enumerate(self.rope_layers) if not r)

    def folded_kv_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, row_scale)``: every K/V row times its layer's hidden norm weight, as float32
        rows ``[L*2*Hk*D, H]`` (fp8 rows dequantized: their weight scale folds in too) each
        divided by its ``row_scale`` (float32 ``[L*2*Hk*D]``): the smallest power of two,
        at least 1, that brings the row within :data:`FOLD_ROW_LIMIT`.

        ``rms_norm(x, w_l) @ W_l.T == ((x / rms(x)) @ (W_l * w_l / s).T) * s``: the statistic
        does not depend on the weight, so a backend runs one GEMM for every layer with these
        rows, then scales each output by ``1 / rms(x)`` and its row's ``s``. The products are
        formed in float64 (exact for float32 operands), one layer at a time, so a fold past
        float32 (a norm weight of 1e20 on weight rows of 1e20) still gives finite rows; the
        caller rounds once to its dtype (a power-of-two division is exact). Rows within the
        limit (every trained draft's) are unscaled. The limit is float16's largest value
        whatever the dtype: a GEMM on states ``|x| < 2**64`` (beyond, SPEC's own float32
        ``mean(x**2)`` overflows) with rows below ``2**16`` stays in float32 for any ``H``
        below ``2**47``, and multiplied by ``1 / rms(x)`` first, by ``s`` last, the result
        overflows only where SPEC's order does. ``s`` stops at ``2**127`` (float32's largest
        power of two): a fold past ``2**143`` (both factors near float32's largest) is
        outside the fold's range (SPEC.md section 2).
        """
        L, H = self.num_layers, self.hidden_size
        kv = self.kv_weight.view(L, -1, H)
        norm = self.hidden_norm_weight.view(-1, 1, H)  # [1 or L, 1, H]
        weight_scale = self.row_scales().view(L, -1, 1)
        rows = torch.empty(kv.shape, dtype=torch.float32, device=self.device)
        scale = torch.empty(kv.shape[:2], dtype=torch.float32, device=self.device)
        for layer in range(L):
            fold = kv[layer].double() * norm[layer % norm.shape[0]].double()
            if self.quantized:  # fp8 rows: their scale folds in too (exact in float64)
                fold = fold * weight_scale[layer].double()
            exponent = torch.ceil(torch.log2(fold.abs().amax(dim=1) / FOLD_ROW_LIMIT)).clamp_(0, 127)
            scale[layer] = torch.exp2(exponent)
            rows[layer] = fold / scale[layer, :, None].double()
        return rows.view(-1, H), scale.view(-1)

    @property
    def device(self) -> torch.device:
        return self.kv_weight.device

    @property
    def dtype(self) -> torch.dtype:
        """``kv_weight``'s dtype: for float rows also the states' (validation holds them
        equal); for fp8 rows the storage format only (:meth:`accepts_states`)."""
        return self.kv_weight.dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
           ) -> "ContextKVWeights":
        """A copy on ``device`` with float tensors in ``dtype`` (cos/sin stays float32; fp8
        rows and their scale keep their dtypes)."""
        def move(t: torch.Tensor | None, keep_dtype: bool = False) -> torch.Tensor | None:
            if t is None:
                return None
            return t.to(device=device, dtype=None if keep_dtype else dtype)
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        for name in ("hidden_norm_weight", "kv_weight", "k_norm_weight", "kv_bias"):
            kwargs[name] = move(kwargs[name], keep_dtype=name == "kv_weight" and self.quantized)
        kwargs["cos_sin_cache"] = move(self.cos_sin_cache, keep_dtype=True)
        kwargs["kv_weight_scale"] = move(self.kv_weight_scale, keep_dtype=True)
        return ContextKVWeights(**kwargs)

    @classmethod
    def from_layers(cls, *, hidden_norm_weight: torch.Tensor | Sequence[torch.Tensor],
                    k_proj_weights: Sequence[torch.Tensor], v_proj_weights: Sequence[torch.Tensor],
                    k_norm_weights: Sequence[torch.Tensor], cos_sin_cache: torch.Tensor, is_neox: bool, eps: float,
                    num_kv_heads: int, head_dim: int, k_proj_biases: Sequence[torch.Tensor] | None = None,
                    v_proj_biases: Sequence[torch.Tensor] | None = None, v_scale: float | None = None,
                    rope_layers: Sequence[bool] | None = None,
                    round_k_before_rope: bool = False, k_proj_scales: Sequence[torch.Tensor] | None = None,
                    v_proj_scales: Sequence[torch.Tensor] | None = None) -> "ContextKVWeights":
        """Stack per-layer ``k_proj``/``v_proj``/``k_norm`` tensors into the fused layout; a
        sequence of per-layer ``hidden_norm_weight`` tensors is stacked to ``[L, H]``. Every
        layer's tensor is checked before anything is stacked (``ValueError`` naming the
        sequence and the layer: a shape or device unlike layer 0's ``k_proj``).

        fp8 projections (a quantized module's ``weight``) come with their float32 scales,
        ``k_proj_scales``/``v_proj_scales``: per layer one scale (``[]`` or ``[1]``,
        per-tensor) or one per row (``[num_kv_heads*head_dim]`` or ``[.., 1]``, per-channel);
        they become one scale per fused row (:attr:`kv_weight_scale`, per-channel)."""
        n = len(k_proj_weights)
        if n == 0 or len(v_proj_weights) != n or len(k_norm_weights) != n:
            raise ValueError(
                f"from_layers: expected the same positive number of k_proj, v_proj and k_norm "
                f"weights, got {len(k_proj_weights)}, {len(v_proj_weights)}, {len(k_norm_weights)}")
        if (k_proj_biases is None) != (v_proj_biases is None):
            raise ValueError("from_layers: give both k_proj_biases and v_proj_biases, or neither")
        if (k_proj_scales is None) != (v_proj_scales is None):
            raise ValueError("from_layers: give both k_proj_scales and v_proj_scales (fp8 projections), or neither")
        first = _layer_tensor("k_proj_weights", 0, k_proj_weights[0])
        H = first.shape[-1] if first.dim() else -1
        rows, cols = (num_kv_heads * head_dim, "num_kv_heads*head_dim"), (H, "hidden")
        per_layer = {"k_proj_weights": (k_proj_weights, (rows, cols)), "v_proj_weights": (v_proj_weights, (rows, cols)),
                     "k_norm_weights": (k_norm_weights, ((head_dim, "head_dim"),))}
        if k_proj_biases is not None:
            per_layer.update(k_proj_biases=(k_proj_biases, (rows,)), v_proj_biases=(v_proj_biases, (rows,)))
        if not isinstance(hidden_norm_weight, torch.Tensor):
            per_layer["hidden_norm_weight"] = (hidden_norm_weight, (cols,))
        for name, (tensors, dims) in per_layer.items():
            if len(tensors) != n:
                raise ValueError(f"from_layers: expected {n} {name} (one per layer), got {len(tensors)}")
            for layer, t in enumerate(tensors):
                _check_layer(name, layer, t, dims, first.device)
        for name in ("k_proj_weights", "v_proj_weights"):  # one format for every row: torch.cat would promote
            for layer, t in enumerate(per_layer[name][0]):
                if t.dtype != first.dtype:
                    raise ValueError(f"from_layers: {name}[{layer}] is {dtype_name(t.dtype)}, k_proj_weights[0] "
                                     f"is {dtype_name(first.dtype)}: every layer's K/V projection must hold one "
                                     "format")
        bias = None
        if k_proj_biases is not None:
            bias = torch.cat([b for pair in zip(k_proj_biases, v_proj_biases) for b in pair])
        if not isinstance(hidden_norm_weight, torch.Tensor):
            hidden_norm_weight = torch.stack(list(hidden_norm_weight))
        rows = [w for pair in zip(k_proj_weights, v_proj_weights) for w in pair]
        scales = None
        if k_proj_scales is not None:
            named = {"k_proj_scales": k_proj_scales, "v_proj_scales": v_proj_scales}
            for name, given in named.items():
                if len(given) != n:
                    raise ValueError(f"from_layers: expected {n} {name} (one per layer), got {len(given)}")
            scales = torch.cat([_row_scales(name, layer, given[layer], num_kv_heads * head_dim, first.device)
                                for layer in range(n) for name, given in named.items()])
        return cls(hidden_norm_weight=hidden_norm_weight, kv_weight=torch.cat(rows, dim=0), kv_weight_scale=scales,
                   kv_bias=bias, k_norm_weight=torch.stack(list(k_norm_weights)),
                   cos_sin_cache=cos_sin_cache, is_neox=is_neox, eps=float(eps), v_scale=v_scale,
                   rope_layers=rope_layers,
                   round_k_before_rope=round_k_before_rope, num_layers=n, num_kv_heads=num_kv_heads,
                   head_dim=head_dim)


def _row_scales(name: str, layer: int, t, rows: int, device: torch.device) -> torch.Tensor:
    """Layer ``layer``'s projection scale as ``rows`` float32 scales (a per-tensor one
    repeated); its values are checked with the fused weights' scale."""
    _layer_tensor(name, layer, t)
    if t.dtype != torch.float32:
        raise TypeError(f"from_layers: {name}[{layer}]: expected float32, got {t.dtype}")
    if not (t.numel() == 1 and t.dim() <= 2 or tuple(t.shape) in ((rows,), (rows, 1))):
        raise ValueError(f"from_layers: {name}[{layer}]: expected [] or [1] (per-tensor) or "
                         f"[num_kv_heads*head_dim] = [{rows}] or [{rows}, 1] (per-channel), got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"from_layers: {name}[{layer}]: on {t.device}, k_proj_weights[0] on {device}")
    return t.detach().reshape(-1).expand(rows)


def _layer_tensor(name: str, layer: int, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_layers: {name}[{layer}]: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _check_layer(name: str, layer: int, t, dims: tuple[tuple[int, str], ...], device: torch.device) -> None:
    """Layer ``layer``'s tensor of the sequence ``name``: shaped ``dims`` (sizes and their
    words), on ``device`` (layer 0's ``k_proj``'s)."""
    _layer_tensor(name, layer, t)
    shape = [size for size, _ in dims]
    if list(t.shape) != shape:
        words = ", ".join(word for _, word in dims)
        raise ValueError(f"from_layers: {name}[{layer}]: expected [{words}] = {shape}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"from_layers: {name}[{layer}]: on {t.device}, k_proj_weights[0] on {device}")


def _expect_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], words: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"ContextKVWeights.{name}: expected {words} = {list(shape)}, got {tuple(t.shape)}")


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
