"""Build ``ContextKVWeights`` from a DFlash draft checkpoint directory.

Tensor names and config keys follow vLLM's ``qwen3_dflash.py``: per-layer
``layers.{i}.self_attn.{k_proj,v_proj,k_norm}``, the ``hidden_norm`` applied to the
context states, and the renames vLLM applies to older drafts (``midlayer.`` is layer 0,
``encoder.output_norm_enc.`` is ``hidden_norm.``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .rope import build_cos_sin_cache, rotary_dim_for
from .weights import ContextKVWeights

_RENAMES = (("midlayer.", "layers.0."), ("encoder.output_norm_enc.", "hidden_norm."))
# vLLM's set_default_rope_theta(config, default_theta=1000000) for DFlash layers.
DEFAULT_ROPE_THETA = 1_000_000.0


def read_draft_config(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a DFlash draft; refuses configs that are not one."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"checkpoint {str(path)!r}: no config.json there")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"checkpoint {str(path)!r}: config.json is not valid JSON ({exc})") from None
    archs = config.get("architectures") or []
    if "DFlashDraftModel" not in archs and "dflash_config" not in config:
        raise ValueError(
            f"checkpoint {str(path)!r} is not a DFlash draft: config.json has architectures={archs} "
            "and no dflash_config (expected architectures ['DFlashDraftModel'])")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if k not in config]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r}: config.json lacks {', '.join(missing)}")
    return config


def rope_parameters_of(config: dict[str, Any]) -> dict[str, Any]:
    """Merge the new (``rope_parameters``) and old (``rope_theta`` + ``rope_scaling``) spellings."""
    params = dict(config.get("rope_parameters") or {})
    params.update({k: v for k, v in (config.get("rope_scaling") or {}).items() if k not in params})
    params.setdefault("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA))
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return params


def _canonical(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model."):]
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


def _load_tensors(path: Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint {str(path)!r}: no *.safetensors files")
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = _canonical(key)
                if name in wanted:
                    found[name] = f.get_tensor(key)
    return found


def load_context_kv_weights(path: str | os.PathLike, *, device: torch.device | str = "cpu",
                            dtype: torch.dtype | None = None) -> ContextKVWeights:
    path = Path(path)
    config = read_draft_config(path)
    L = int(config["num_hidden_layers"])
    Hq = int(config["num_attention_heads"])
    Hk = int(config.get("num_key_value_heads", Hq))
    D = int(config.get("head_dim") or config["hidden_size"] // Hq)
    has_bias = bool(config.get("attention_bias", False))
    names = {"hidden_norm.weight"}
    for i in range(L):
        prefix = f"layers.{i}.self_attn."
        names |= {prefix + "k_proj.weight", prefix + "v_proj.weight", prefix + "k_norm.weight"}
        if has_bias:
            names |= {prefix + "k_proj.bias", prefix + "v_proj.bias"}
    tensors = _load_tensors(path, names)
    missing = sorted(names - tensors.keys())
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ValueError(f"checkpoint {str(path)!r}: missing tensors {shown}")

    params = rope_parameters_of(config)
    rotary_dim = rotary_dim_for(D, params)
    max_position = int(config.get("max_position_embeddings", 4096 * 32))
    dflash = config.get("dflash_config") or {}
    v_scale = dflash.get("attention_value_scale")

    def layer(i: int, part: str) -> torch.Tensor:
        return tensors[f"layers.{i}.self_attn.{part}"]

    weights = ContextKVWeights.from_layers(
        hidden_norm_weight=tensors["hidden_norm.weight"],
        k_proj_weights=[layer(i, "k_proj.weight") for i in range(L)],
        v_proj_weights=[layer(i, "v_proj.weight") for i in range(L)],
        k_norm_weights=[layer(i, "k_norm.weight") for i in range(L)],
        k_proj_biases=[layer(i, "k_proj.bias") for i in range(L)] if has_bias else None,
        v_proj_biases=[layer(i, "v_proj.bias") for i in range(L)] if has_bias else None,
        cos_sin_cache=build_cos_sin_cache(rotary_dim, max_position, params),
        is_neox=bool(config.get("is_neox_style", True)),
        eps=float(config.get("rms_norm_eps", 1e-6)),
        num_kv_heads=Hk, head_dim=D,
        v_scale=None if v_scale is None else float(v_scale),
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
        if forced is not None:
            causal = bool(forced)
        else:
            causal = bool(layer_types) and layer_types[i] == "sliding_attention"
        modes.append((window, causal))
    return modes
