"""Build ``ContextKVWeights`` from a DFlash draft checkpoint directory.

Tensor names and config keys follow vLLM's ``qwen3_dflash.py``: per-layer
``layers.{i}.self_attn.{k_proj,v_proj,k_norm}``, the ``hidden_norm`` applied to the
context states, and the renames vLLM applies to older drafts (``midlayer.`` is layer 0,
``encoder.output_norm_enc.`` is ``hidden_norm.``). Two variants of the family read from
the config: ``no_rope_layers`` (Ricursive DFlash2 drafts: the indices of layers whose K is
not rotated) and the Beam DFlash2 architecture, whose precompute rounds the normed K
before RoPE.

What cannot be served is refused with a ``ValueError`` naming the file (and the tensor
or config key) *before* anything large is allocated: the config is checked first (a
DFlash draft, ints where ints belong, heads that divide, a RoPE table of bounded
length), then every needed tensor's dtype and shape from the safetensors headers, and
only then are the tensors read, one at a time through the file's memory map. Only the
files that hold needed tensors are opened (``model.safetensors.index.json`` says which,
when present). Quantised weights (int8, fp8, packed ints) are refused: the precompute
computes in floating point and would silently use the raw integers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .rope import build_cos_sin_cache, cos_sin_cache_rows, rotary_dim_for
from .weights import ContextKVWeights

_RENAMES = (("midlayer.", "layers.0."), ("encoder.output_norm_enc.", "hidden_norm."))
# vLLM's set_default_rope_theta(config, default_theta=1000000) for DFlash layers.
DEFAULT_ROPE_THETA = 1_000_000.0
DEFAULT_MAX_POSITION = 4096 * 32
INDEX_FILE = "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20
MAX_DRAFT_LAYERS = 1024  # drafts have a handful; the bound keeps a broken config from listing 1e9 names
# safetensors dtype names of the weights the precompute can take.
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
# vLLM 0.34's models/beam: the K RMSNorm's output is rounded to bf16 before RoPE.
ROUNDS_K_BEFORE_ROPE = ("DFlash2BeamDraftModel",)


def _read_json(file: Path, what: str) -> Any:
    try:
        with open(file, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{what} {str(file)!r}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"{what} {str(file)!r}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deeply
        raise ValueError(f"{what} {str(file)!r} is not valid JSON ({type(exc).__name__}: {exc})") from None


def read_draft_config(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a DFlash draft; refuses configs that are not one."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"checkpoint {str(path)!r}: no config.json there")
    config = _read_json(config_path, "config")
    if not isinstance(config, dict):
        raise ValueError(f"config {str(config_path)!r}: expected a JSON object, got a {type(config).__name__}")
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        raise ValueError(f"config {str(config_path)!r}: architectures must be a list, got {archs!r}")
    if "DFlashDraftModel" not in archs and "dflash_config" not in config:
        raise ValueError(
            f"checkpoint {str(path)!r} is not a DFlash draft: config.json has architectures={archs} "
            "and no dflash_config (expected architectures ['DFlashDraftModel'])")
    if not isinstance(config.get("dflash_config") or {}, dict):
        raise ValueError(f"config {str(config_path)!r}: dflash_config must be an object")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if k not in config]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r}: config.json lacks {', '.join(missing)}")
    return config


def _int(config: dict[str, Any], key: str, where: Path, default: int | None = None) -> int:
    value = config.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config {str(where)!r}: {key} must be a positive int, got {value!r}")
    return value


def config_flag(config: dict[str, Any], key: str, where: Path, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"config {str(where)!r}: {key} must be true or false, got {value!r}")
    return value


def _number(value: Any, key: str, where: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"config {str(where)!r}: {key} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DraftDims:
    """The sizes a draft's config declares, checked: what the tensors must match."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    bias: bool

    @classmethod
    def of(cls, config: dict[str, Any], path: Path) -> "DraftDims":
        where = path / "config.json"
        L = _int(config, "num_hidden_layers", where)
        if L > MAX_DRAFT_LAYERS:
            raise ValueError(f"config {str(where)!r}: num_hidden_layers {L} is not a draft's (max {MAX_DRAFT_LAYERS})")
        H = _int(config, "hidden_size", where)
        Hq = _int(config, "num_attention_heads", where)
        Hk = _int(config, "num_key_value_heads", where, default=Hq)
        if Hq % Hk:
            raise ValueError(f"config {str(where)!r}: num_key_value_heads {Hk} does not divide "
                             f"num_attention_heads {Hq}")
        if config.get("head_dim") is None and H % Hq:
            raise ValueError(f"config {str(where)!r}: no head_dim, and hidden_size {H} is not a multiple of "
                             f"num_attention_heads {Hq}")
        D = _int(config, "head_dim", where, default=H // Hq)
        return cls(L, Hq, Hk, D, H, config_flag(config, "attention_bias", where, False))


def rope_parameters_of(config: dict[str, Any]) -> dict[str, Any]:
    """Merge the new (``rope_parameters``) and old (``rope_theta`` + ``rope_scaling``) spellings."""
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(config.get(key) or {}, dict):
            raise ValueError(f"{key} must be an object, got {config[key]!r}")
    params = dict(config.get("rope_parameters") or {})
    params.update({k: v for k, v in (config.get("rope_scaling") or {}).items() if k not in params})
    params.setdefault("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA))
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return params


@dataclass(frozen=True)
class RopeSetup:
    rotary_dim: int
    max_position: int
    params: dict[str, Any]


def rope_setup(config: dict[str, Any], dims: DraftDims, path: Path) -> RopeSetup:
    """The RoPE table's parameters, checked (length bounded) without building it."""
    where = path / "config.json"
    try:
        params = rope_parameters_of(config)
        rotary_dim = rotary_dim_for(dims.head_dim, params)
        max_position = _int(config, "max_position_embeddings", where, default=DEFAULT_MAX_POSITION)
        cos_sin_cache_rows(max_position, params)
    except ValueError as exc:
        raise ValueError(f"config {str(where)!r}: {exc}") from None
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"config {str(where)!r}: rotary dim {rotary_dim} (head_dim {dims.head_dim} times "
                         "partial_rotary_factor) must be even and >= 2")
    return RopeSetup(rotary_dim, max_position, params)


def rope_layers_of(config: dict[str, Any], layers: int, where: Path) -> tuple[bool, ...] | None:
    """Per layer, whether its K is rotated: False for the indices in ``no_rope_layers`` (vLLM
    serves a DFlash2 draft that lists any as ``DFlash2RicursiveDraftModel``); None: all are."""
    nope = config.get("no_rope_layers") or []
    if not isinstance(nope, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in nope):
        raise ValueError(f"config {str(where)!r}: no_rope_layers must be a list of layer indices in "
                         f"[0, num_hidden_layers={layers}), got {nope!r}")
    return tuple(i not in nope for i in range(layers)) if nope else None


def _canonical(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model."):]
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


def _expected_tensors(dims: DraftDims) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor the precompute needs."""
    kv_rows = dims.kv_heads * dims.head_dim
    shapes = {"hidden_norm.weight": (dims.hidden,)}
    for i in range(dims.layers):
        prefix = f"layers.{i}.self_attn."
        shapes[prefix + "k_proj.weight"] = (kv_rows, dims.hidden)
        shapes[prefix + "v_proj.weight"] = (kv_rows, dims.hidden)
        shapes[prefix + "k_norm.weight"] = (dims.head_dim,)
        if dims.bias:
            shapes[prefix + "k_proj.bias"] = (kv_rows,)
            shapes[prefix + "v_proj.bias"] = (kv_rows,)
    return shapes


def _safetensors_error() -> type[Exception]:
    from safetensors import SafetensorError
    return SafetensorError


class _Files:
    """Open safetensors files (headers parsed, data memory-mapped), each opened once."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._open: dict[Path, Any] = {}
        self._names: dict[Path, set[str]] = {}

    def get(self, file: Path):
        if file not in self._open:
            from safetensors import safe_open
            try:
                self._open[file] = self._stack.enter_context(safe_open(str(file), framework="pt"))
            except (OSError, _safetensors_error()) as exc:
                raise ValueError(f"checkpoint file {str(file)!r} is not a readable safetensors file "
                                 f"({type(exc).__name__}: {exc})") from None
        return self._open[file]

    def names(self, file: Path) -> set[str]:
        """The tensor names ``file``'s header holds."""
        if file not in self._names:
            self._names[file] = set(self.get(file).keys())
        return self._names[file]


def _sources(path: Path, wanted: set[str], files: _Files) -> dict[str, tuple[Path, str]]:
    """Canonical name -> (file, stored name) for the wanted tensors found, opening only
    files the index names for them (or, without an index, every ``*.safetensors``)."""
    index_path = path / INDEX_FILE
    if index_path.exists():
        index = _read_json(index_path, "index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError(f"index {str(index_path)!r}: expected a weight_map of tensor name -> file name")
        found = {}
        for stored, file_name in weight_map.items():
            name = _canonical(stored)
            if name not in wanted:
                continue
            if Path(file_name).name != file_name or not file_name:
                raise ValueError(f"index {str(index_path)!r}: {stored} is in {file_name!r}, not a file of "
                                 "the checkpoint directory")
            found[name] = (path / file_name, stored)
        return found
    candidates = sorted(path.glob("*.safetensors"))
    if not candidates:
        raise ValueError(f"checkpoint {str(path)!r}: no *.safetensors files")
    found = {}
    for file in candidates:
        for stored in files.get(file).keys():
            name = _canonical(stored)
            if name in wanted:
                found.setdefault(name, (file, stored))
    return found


def _check_header(handle, stored: str, file: Path, shape: tuple[int, ...]) -> None:
    """The tensor's dtype and shape, from the header alone."""
    view = handle.get_slice(stored)
    dtype_name, got = view.get_dtype(), tuple(view.get_shape())
    if dtype_name not in FLOAT_DTYPES:
        raise ValueError(f"checkpoint file {str(file)!r}: tensor {stored} is {dtype_name}; expected F16, BF16 or "
                         "F32 (quantised drafts are not supported: dequantise the K/V projections first)")
    if got != shape:
        raise ValueError(f"checkpoint file {str(file)!r}: tensor {stored} has shape {list(got)}, expected "
                         f"{list(shape)} from config.json")


def _load_tensors(path: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    with contextlib.ExitStack() as stack:
        files = _Files(stack)
        sources = _sources(path, set(expected), files)
        missing = sorted(set(expected) - sources.keys())
        if missing:
            shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
            raise ValueError(f"checkpoint {str(path)!r}: missing tensors {shown}")
        for name, (file, stored) in sources.items():  # every header first: nothing is read yet
            if stored not in files.names(file):  # only an index can name a file without the tensor
                raise ValueError(f"index {str(path / INDEX_FILE)!r}: tensor {stored} is in {file.name!r}, which "
                                 "does not hold it")
            _check_header(files.get(file), stored, file, expected[name])
        tensors = {}
        for name, (file, stored) in sources.items():
            try:
                tensor = files.get(file).get_tensor(stored)
            except (OSError, RuntimeError, _safetensors_error()) as exc:
                raise ValueError(f"checkpoint file {str(file)!r}: tensor {stored} cannot be read "
                                 f"({type(exc).__name__}: {exc})") from None
            if not torch.isfinite(tensor).all():
                raise ValueError(f"checkpoint file {str(file)!r}: tensor {stored} holds NaN or Inf")
            tensors[name] = tensor
        return tensors


def load_context_kv_weights(path: str | os.PathLike, *, device: torch.device | str = "cpu",
                            dtype: torch.dtype | None = None) -> ContextKVWeights:
    path = Path(path)
    config = read_draft_config(path)
    where = path / "config.json"
    dims = DraftDims.of(config, path)
    rope = rope_setup(config, dims, path)
    eps = _number(config.get("rms_norm_eps", 1e-6), "rms_norm_eps", where)
    if eps <= 0:
        raise ValueError(f"config {str(where)!r}: rms_norm_eps must be positive, got {eps}")
    is_neox = config_flag(config, "is_neox_style", where, True)
    v_scale = (config.get("dflash_config") or {}).get("attention_value_scale")
    if v_scale is not None:
        v_scale = _number(v_scale, "dflash_config.attention_value_scale", where)
    rope_layers = rope_layers_of(config, dims.layers, where)
    if dtype is not None and dtype not in FLOAT_DTYPES.values():
        raise TypeError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")

    tensors = _load_tensors(path, _expected_tensors(dims))

    def layer(i: int, part: str) -> torch.Tensor:
        return tensors[f"layers.{i}.self_attn.{part}"]

    L = dims.layers
    weights = ContextKVWeights.from_layers(
        hidden_norm_weight=tensors["hidden_norm.weight"],
        k_proj_weights=[layer(i, "k_proj.weight") for i in range(L)],
        v_proj_weights=[layer(i, "v_proj.weight") for i in range(L)],
        k_norm_weights=[layer(i, "k_norm.weight") for i in range(L)],
        k_proj_biases=[layer(i, "k_proj.bias") for i in range(L)] if dims.bias else None,
        v_proj_biases=[layer(i, "v_proj.bias") for i in range(L)] if dims.bias else None,
        cos_sin_cache=build_cos_sin_cache(rope.rotary_dim, rope.max_position, rope.params),
        is_neox=is_neox, eps=eps, num_kv_heads=dims.kv_heads, head_dim=dims.head_dim, v_scale=v_scale,
        rope_layers=rope_layers,
        round_k_before_rope=any(a in ROUNDS_K_BEFORE_ROPE for a in config.get("architectures") or []),
    )
    if dtype is None:
        dtype = weights.kv_weight.dtype
    return weights.to(device=device, dtype=dtype)


def layer_attention_modes(config: dict[str, Any]) -> list[tuple[int | None, bool]]:
    """``(sliding_window, causal)`` per draft layer, resolved as vLLM's
    ``qwen3_dflash._resolve_layer_attention`` does (``use_swa``, ``layer_types``,
    ``dflash_config.causal`` / ``is_causal`` overriding every layer)."""
    dflash = config.get("dflash_config") or {}
    layer_types = config.get("layer_types")
    L = int(config["num_hidden_layers"])
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) < L):
        raise ValueError(f"layer_types: expected a list of {L} layer types, got {layer_types!r}")
    use_swa = dflash.get("use_swa", False)
    any_sliding = bool(layer_types) and any(t == "sliding_attention" for t in layer_types)
    forced = config.get("is_causal")
    if forced is None:
        forced = dflash.get("causal")
    modes = []
    for i in range(L):
        if layer_types is None or (use_swa and not any_sliding):
            sliding = bool(use_swa)
        else:
            sliding = layer_types[i] == "sliding_attention"
        window = dflash.get("swa_window_size", config.get("sliding_window")) if sliding else None
        if sliding and window is None:
            raise ValueError("DFlash sliding attention needs dflash_config.swa_window_size or sliding_window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding window: expected a positive int, got {window!r}")
        if forced is not None:
            causal = bool(forced)
        else:
            causal = bool(layer_types) and layer_types[i] == "sliding_attention"
        modes.append((window, causal))
    return modes
