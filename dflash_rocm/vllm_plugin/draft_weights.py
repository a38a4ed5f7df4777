"""The precompute's weights, read from a loaded vLLM draft's own modules.

They are taken right after the draft's ``load_weights``, the one point where every vLLM
release (0.32-0.34) has them plain: vLLM 0.34 builds its own fused buffers only later,
in ``process_weights_after_loading`` and only off CPU, and on CPU post-load processing
repacks ``qkv_proj.weight`` for its GEMM library. So nothing here reads vLLM's derived
buffers (``_fused_kv_weight``, ``_hidden_norm_weight``, ...): each layer's
``qkv_proj``, ``k_norm`` and rotary embedding, and the model's ``hidden_norm``.

The tensors a :class:`ContextKVWeights` holds here are the plugin's own copies. A weight
reload writes the new values into them in place (:class:`ReloadTee`), which the
backends' derived layouts follow at the same addresses (:mod:`dflash_rocm.derived`), so
a CUDA graph captured before the reload replays with the new weights.
"""

from __future__ import annotations

import re

import torch

from ..weights import ContextKVWeights


def _unquantised(linear) -> bool:
    method = getattr(linear, "quant_method", None)
    return method is None or type(method).__name__ == "UnquantizedLinearMethod"


def _rope_of(attns, rope_layers) -> object | str:
    """The one RoPE table the rotated layers share (any layer's where none is rotated), or why not."""
    rotated = [a.rotary_emb for a, on in zip(attns, rope_layers) if on] or [attns[0].rotary_emb]
    rope = rotated[0]
    for other in rotated[1:]:
        if (other.is_neox_style != rope.is_neox_style or other.head_size != rope.head_size
                or not torch.equal(other.cos_sin_cache, rope.cos_sin_cache)):
            return "the draft's layers use different RoPE tables"
    return rope


def read(inner, *, rope_layers: tuple[bool, ...] | None = None,
         per_layer_norm: bool = False) -> ContextKVWeights | str:
    """``inner`` (a ``DFlashQwen3Model``)'s precompute weights, or why they cannot be read.
    ``rope_layers``: the layers whose K is rotated (None: all; see :func:`.family.rope_layers`);
    ``per_layer_norm``: each layer's ``input_layernorm`` normalises the context (Laguna),
    stacked to an ``[L, H]`` hidden norm weight, else the model's ``hidden_norm``.
    Never raises for a model vLLM built: an attribute it lacks is a reason."""
    try:
        attns = [layer.self_attn for layer in inner.layers]
        quantised = sorted({type(a.qkv_proj.quant_method).__name__ for a in attns if not _unquantised(a.qkv_proj)})
        if quantised:
            return f"the draft's K/V projections are quantised ({', '.join(quantised)})"
        first = attns[0]
        rope = _rope_of(attns, rope_layers or (True,) * len(attns))
        if isinstance(rope, str):
            return rope
        for a in attns[1:]:
            if (a.num_kv_heads, a.head_dim, a.q_norm.variance_epsilon) != (
                    first.num_kv_heads, first.head_dim, first.q_norm.variance_epsilon):
                return "the draft's layers differ in KV heads, head size or norm epsilon"
        with torch.no_grad():
            kv_weight = torch.cat([a.qkv_proj.weight[a.q_size:] for a in attns])
            has_bias = getattr(first.qkv_proj, "bias", None) is not None
            kv_bias = torch.cat([a.qkv_proj.bias[a.q_size:] for a in attns]) if has_bias else None
            k_norm = torch.stack([a.k_norm.weight for a in attns])
            if per_layer_norm:
                hidden_norm = torch.stack([layer.input_layernorm.weight.detach() for layer in inner.layers])
            else:
                hidden_norm = inner.hidden_norm.weight.detach().clone()
        v_scale = getattr(first, "v_scale", None)
        return ContextKVWeights(
            hidden_norm_weight=hidden_norm, kv_weight=kv_weight, kv_bias=kv_bias, k_norm_weight=k_norm,
            cos_sin_cache=rope.cos_sin_cache, is_neox=bool(rope.is_neox_style),
            eps=float(first.q_norm.variance_epsilon), v_scale=None if v_scale is None else float(v_scale),
            num_layers=len(attns), num_kv_heads=int(first.num_kv_heads), head_dim=int(first.head_dim),
            rope_layers=rope_layers)
    except (AttributeError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        return f"cannot read the draft's K/V weights ({type(exc).__name__}: {exc})"


_QKV_PARAM = re.compile(r"^layers\.(\d+)\.self_attn\.qkv_proj\.(weight|bias)$")
_K_NORM_PARAM = re.compile(r"^layers\.(\d+)\.self_attn\.k_norm\.weight$")
_INPUT_NORM_PARAM = re.compile(r"^layers\.(\d+)\.input_layernorm\.weight$")


class ReloadTee:
    """The new values of a weight reload, taken from the checkpoint stream as vLLM loads it.

    A reload cannot be read from the layers afterwards: vLLM reloads layer by layer and
    processes each as it completes (on CPU, repacking ``qkv_proj.weight`` for its GEMM
    library), and some of its buffers are placeholders until the end. The stream itself
    holds the checkpoint's tensors: names are mapped as the draft's own loader maps them
    (``hf_to_vllm_mapper``) and each layer's K/V rows narrowed to this rank's heads as its
    ``qkv_proj`` loads them. What the stream does not name keeps its value.
    """

    def __init__(self, inner):
        self._inner = inner
        self._mapper = getattr(type(inner), "hf_to_vllm_mapper", None)
        self._seen: list[tuple[str, int, str | None, torch.Tensor]] = []  # (param, layer, shard, tensor)

    def watch(self, weights):
        for name, tensor in weights:
            self._see(name, tensor)
            yield name, tensor

    def _see(self, name: str, tensor: torch.Tensor) -> None:
        mapped = self._mapper._map_name_with_shard(name) if self._mapper is not None else (name, None)
        if mapped is None:
            return
        param, shard = mapped
        if param == "hidden_norm.weight":
            self._seen.append(("hidden_norm", 0, None, tensor))
        elif (m := _K_NORM_PARAM.match(param)) is not None:
            self._seen.append(("k_norm", int(m[1]), None, tensor))
        elif (m := _INPUT_NORM_PARAM.match(param)) is not None:
            self._seen.append(("input_norm", int(m[1]), None, tensor))
        elif (m := _QKV_PARAM.match(param)) is not None and shard in ("k", "v", None):
            self._seen.append((m[2], int(m[1]), shard, tensor))

    def refill(self, held: ContextKVWeights) -> str | None:
        """Write what the stream held into ``held``'s tensors in place; why not (nothing
        written) if a tensor does not fit."""
        writes = []
        for kind, layer, shard, tensor in self._seen:
            if kind == "hidden_norm" and held.per_layer_hidden_norm:
                continue  # the model's own hidden norm; the precompute's are the layers' input norms
            if kind == "hidden_norm":
                writes.append((held.hidden_norm_weight, tensor))
                continue
            if layer >= held.num_layers:
                return f"the reload names draft layer {layer} of {held.num_layers}"
            if kind == "input_norm":
                if held.per_layer_hidden_norm:
                    writes.append((held.hidden_norm_weight[layer], tensor))
            elif kind == "k_norm":
                writes.append((held.k_norm_weight[layer], tensor))
            elif (found := self._kv_writes(held, kind, layer, shard, tensor)) is not None:
                if isinstance(found, str):
                    return found
                writes.extend(found)
        for dst, src in writes:
            if dst.shape != src.shape:
                return f"a reloaded tensor of shape {list(src.shape)} does not fit {list(dst.shape)}"
        with torch.no_grad():
            for dst, src in writes:
                dst.copy_(src)
        return None

    def _kv_writes(self, held: ContextKVWeights, kind: str, layer: int, shard: str | None, tensor: torch.Tensor):
        """Where a layer's K and V rows of a streamed ``qkv_proj`` tensor go (this rank's
        heads): a ``k``/``v`` shard, or a fused ``qkv`` tensor (Laguna's checkpoints) on one rank."""
        rows = held.num_kv_heads * held.head_dim
        target = held.kv_weight if kind == "weight" else held.kv_bias
        if target is None:
            return "the reload brings a K/V bias the loaded draft did not have"
        qkv = self._inner.layers[layer].self_attn.qkv_proj
        start = 2 * layer * rows
        if shard is None:
            if getattr(qkv, "tp_size", 1) != 1:
                return "the reload brings a fused qkv_proj under tensor parallelism"
            q_rows = tensor.shape[0] - 2 * rows
            if q_rows < 0:
                return (f"the reload's layers.{layer}.self_attn.qkv_proj.{kind} has {tensor.shape[0]} rows, fewer "
                        f"than its layer's K and V rows ({2 * rows})")
            return [(target[start:start + 2 * rows], tensor.narrow(0, q_rows, 2 * rows))]
        rank = getattr(qkv, "tp_rank", 0) // getattr(qkv, "num_kv_head_replicas", 1)
        start += (shard == "v") * rows
        return [(target[start:start + rows], tensor.narrow(0, rank * rows, rows))]
