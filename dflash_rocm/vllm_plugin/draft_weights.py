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

import contextlib
import re

import torch

from ..weights import ContextKVWeights
from . import quantized

QUANTIZED_KV = "_dflash_quantized_kv"  # on the draft's inner model: a quantized draft's K/V shard sources


def _unquantised(linear) -> bool:
    method = getattr(linear, "quant_method", None)
    return method is None or type(method).__name__ == "UnquantizedLinearMethod"


class QuantizedKV:
    """A quantized draft's K/V rows at the read point: per layer and shard (``k``, ``v``)
    the checkpoint-layout tensors of this rank's rows (:func:`.quantized.shard_tensors`),
    the parameters' output dimensions as loaded, and the method's closed form, so a reload
    that streams some of them recomputes the dense rows from the rest."""

    def __init__(self, attns):
        self.methods = sorted({quantized.describe(a.qkv_proj) for a in attns})
        self.declined: str | None = None  # why fp8 rows were dequantized (fp8_kv)
        self.readers, self.shards, self.dims = [], [], []
        # per layer: block scales (dequantized, never kept as fp8 rows)
        self.blocked = [(getattr(a.qkv_proj, "weight_block_size", None) or getattr(
            getattr(a.qkv_proj.quant_method, "quant_config", None), "weight_block_size", None)) is not None
            for a in attns]
        for a in attns:
            read = quantized.reader(a.qkv_proj)
            if isinstance(read, str):
                raise ValueError(read)
            rows = a.num_kv_heads * a.head_dim
            shards, dims = {}, quantized.output_dims(a.qkv_proj)
            self.dims.append(dims)
            for name, start in (("k", a.q_size), ("v", a.q_size + rows)):
                found = quantized.shard_tensors(a.qkv_proj, start, start + rows, dims=dims)
                if isinstance(found, str):
                    raise ValueError(found)
                shards[name] = found
            self.readers.append(read)
            self.shards.append(shards)

    def rows(self, layer: int, shard: str, dtype: torch.dtype) -> torch.Tensor:
        """One shard's dense rows, rounded once to ``dtype``."""
        return self.readers[layer](self.shards[layer][shard]).to(dtype)

    def kv_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([self.rows(layer, shard, dtype) for layer in range(len(self.shards)) for shard in "kv"])

    def fp8_shard(self, layer: int, shard: str, rows: int, tensors: dict | None = None,
                  fmt: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One shard's fp8 codes and float32 per-row scales (:func:`.quantized.fp8_rows`; of
        ``tensors`` when given, else the held ones), in format ``fmt`` (e4m3fnuz: converted
        from e4m3fn), or None when they are not fp8 rows of a kept format."""
        found = quantized.fp8_rows(self.shards[layer][shard] if tensors is None else tensors, rows)
        if found is None or self.blocked[layer]:
            return None
        if fmt == torch.float8_e4m3fnuz:
            found = quantized.as_fnuz(*found)
        return found if fmt is None or found[0].dtype == fmt else None

    def fp8_kv(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer's K/V rows as fp8 codes with a float32 scale per row (``kv_weight``
        and ``kv_weight_scale`` of :class:`ContextKVWeights`) when they are fp8 rows with
        per-tensor or per-channel scales and the backend the precompute gets on ``device``
        reads them no slower than dense rows (e4m3fn converted to e4m3fnuz where only that is
        read: MI300); else None, and ``declined`` says why when they were such rows."""
        self.declined = None
        shards = [self.fp8_shard(layer, shard, rows) for layer in range(len(self.shards)) for shard in "kv"]
        if any(found is None for found in shards) or len({codes.dtype for codes, _ in shards}) != 1:
            return None
        declined = {f: _fp8_rows_declined(f, device) for f in (shards[0][0].dtype, torch.float8_e4m3fnuz)}
        fmt = next((f for f, why in declined.items() if why is None), None)
        if fmt is None:
            self.declined = "; ".join(dict.fromkeys(declined.values()))
            return None
        if fmt != shards[0][0].dtype:
            shards = [quantized.as_fnuz(*found) for found in shards]
        return (torch.cat([codes.view(torch.uint8) for codes, _ in shards]).view(fmt),
                torch.cat([scale for _, scale in shards]).contiguous())


def _fp8_rows_declined(fmt: torch.dtype, device: torch.device) -> str | None:
    """None when a backend the plugin's precompute gets on ``device`` reads fp8 rows of
    ``fmt`` as they are and no slower than dense rows (``slower_weight_reasons``): the
    environment's named backend, else any of ``auto``'s that is available here and
    implements the precompute (auto passes over one that does not read them), the
    reference excepted (a last resort, not a reason to keep fp8 rows); else why not (each
    distinct reason the candidates gave, once)."""
    from .. import dispatch
    from ..ops import PRECOMPUTE
    from ..planning import switches
    from ..platform import platform_for

    platform = platform_for(device)
    name = dispatch.resolve_name(None)
    classes = [c for c in dispatch.candidates(device) if c.name != "reference"] if name == "auto" else [
        dispatch.backend(name)]
    reasons: dict[str, None] = {}
    for backend in classes:
        impl = None if backend is None else backend.implementation(PRECOMPUTE)
        if impl is None or backend.device_not_supported_reasons(device, platform, switches()):
            continue
        why = impl.weight_reasons(fmt, platform) or impl.slower_weight_reasons(fmt, platform)
        if not why:
            return None
        reasons.update(dict.fromkeys(why))
    return "; ".join(reasons) or f"no backend available here reads {fmt} rows"


def _rope_of(attns, rope_layers) -> object | str:
    """The one RoPE table the rotated layers share (any layer's where none is rotated), or why not."""
    rotated = [a.rotary_emb for a, on in zip(attns, rope_layers) if on] or [attns[0].rotary_emb]
    rope = rotated[0]
    for other in rotated[1:]:
        if (other.is_neox_style != rope.is_neox_style or other.head_size != rope.head_size
                or not torch.equal(other.cos_sin_cache, rope.cos_sin_cache)):
            return "the draft's layers use different RoPE tables"
    return rope


def read(inner, *, rope_layers: tuple[bool, ...] | None = None, per_layer_norm: bool = False,
         skeleton: bool = False) -> ContextKVWeights | str:
    """``inner`` (a ``DFlashQwen3Model``)'s precompute weights, or why they cannot be read.
    ``rope_layers``: the layers whose K is rotated (None: all; see :func:`.family.rope_layers`);
    ``per_layer_norm``: each layer's ``input_layernorm`` normalises the context (Laguna),
    stacked to an ``[L, H]`` hidden norm weight, else the model's ``hidden_norm``.
    ``skeleton``: zero K/V rows of the right shape instead of the layers' (after a
    ``load_format=dummy`` start, when post-load processing may have repacked them): tensors
    for the first weight update to fill (:class:`ReloadTee`). Never reads a meta tensor
    (a layerwise reload in progress) and never raises for a model vLLM built: an attribute
    it lacks is a reason."""
    try:
        attns = [layer.self_attn for layer in inner.layers]
        first = attns[0]
        rope = _rope_of(attns, rope_layers or (True,) * len(attns))
        if isinstance(rope, str):
            return rope
        for a in attns[1:]:
            if (a.num_kv_heads, a.head_dim, a.q_norm.variance_epsilon) != (
                    first.num_kv_heads, first.head_dim, first.q_norm.variance_epsilon):
                return "the draft's layers differ in KV heads, head size or norm epsilon"
        plain = all(_unquantised(a.qkv_proj) for a in attns)
        if skeleton and not plain:
            return "a quantized draft started without weights (load_format=dummy)"
        has_bias = getattr(first.qkv_proj, "bias", None) is not None
        norms = [a.k_norm.weight for a in attns] + (
            [layer.input_layernorm.weight for layer in inner.layers] if per_layer_norm else [inner.hidden_norm.weight])
        kv_parts = [t for a in attns for t in (a.qkv_proj.weight, a.qkv_proj.bias) if t is not None] if (
            plain and not skeleton) else []
        if any(t.is_meta for t in norms + kv_parts + [rope.cos_sin_cache]):
            return "the draft's weights are on the meta device (a layerwise weight update in progress)"
        with torch.no_grad():
            source = kv_weight_scale = None
            if skeleton:
                rows = len(attns) * 2 * first.num_kv_heads * first.head_dim
                dtype = getattr(first.qkv_proj, "params_dtype", first.k_norm.weight.dtype)
                device = first.k_norm.weight.device
                kv_weight = torch.zeros(rows, norms[-1].shape[-1], dtype=dtype, device=device)
                kv_bias = torch.zeros(rows, dtype=dtype, device=device) if has_bias else None
            elif not plain:
                source = QuantizedKV(attns)
                kept = source.fp8_kv(first.num_kv_heads * first.head_dim, first.k_norm.weight.device)
                if kept is not None:  # fp8 rows read as they are: no dense copy
                    kv_weight, kv_weight_scale = kept
                else:
                    kv_weight = source.kv_weight(first.k_norm.weight.dtype)
                kv_bias = torch.cat([a.qkv_proj.bias[a.q_size:] for a in attns]) if has_bias else None
            else:
                kv_weight = torch.cat([a.qkv_proj.weight[a.q_size:] for a in attns])
                kv_bias = torch.cat([a.qkv_proj.bias[a.q_size:] for a in attns]) if has_bias else None
            setattr(inner, QUANTIZED_KV, source)
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
            rope_layers=rope_layers, kv_weight_scale=kv_weight_scale)
    except (AttributeError, TypeError, ValueError, IndexError, RuntimeError, KeyError) as exc:
        return f"cannot read the draft's K/V weights ({type(exc).__name__}: {exc})"


def quantized_methods(inner) -> list[str]:
    """The quantization methods of the draft's K/V projections the plugin dequantizes
    (empty for a plain draft or before the read)."""
    source = getattr(inner, QUANTIZED_KV, None)
    return source.methods if source is not None else []


_QKV_PARAM = re.compile(r"^layers\.(\d+)\.self_attn\.qkv_proj\.(bias|" + "|".join(quantized.WEIGHT_TENSORS) + ")$")
_K_NORM_PARAM = re.compile(r"^layers\.(\d+)\.self_attn\.k_norm\.weight$")
_INPUT_NORM_PARAM = re.compile(r"^layers\.(\d+)\.input_layernorm\.weight$")
# What feeds the context K/V, under any naming: a name like this that the tee cannot
# place means the reload changed K/V inputs the plugin did not take.
_KV_INPUT = re.compile(r"(self_attn\.(qkv_proj|kv_proj|k_proj|v_proj|k_norm)|hidden_norm|input_layernorm)\.")


class ReloadTee:
    """The new values of a weight update, taken from the checkpoint stream as vLLM loads it.

    An update cannot be read from the layers afterwards: vLLM reloads layer by layer and
    processes each as it completes (on CPU, repacking ``qkv_proj.weight`` for its GEMM
    library; in layerwise mode the layers sit on the meta device meanwhile), and some of
    its buffers are placeholders until the end. The stream itself holds the checkpoint's
    tensors. It is taken where the draft's own ``DFlashQwen3Model.load_weights`` gets it
    (:meth:`attached`), after the top-level class's renaming (LiLiCorr strips ``model.``)
    and as vLLM 0.34's own ``_tee_context_kv`` takes it: names mapped with that class's
    ``hf_to_vllm_mapper``, each layer's K/V rows narrowed to this rank's heads as its
    ``qkv_proj`` loads them (not for ``is_sharded_weight`` parameters, which vLLM does not
    narrow). What the stream does not name keeps its value.

    One tee lasts one update (every ``load_weights`` call until the post-load hook): it
    records which inputs the update covered (:meth:`covers`), and every name that feeds
    the K/V but could not be placed (:attr:`unplaced`).
    """

    def __init__(self, inner):
        self._inner = inner
        self._mapper = getattr(type(inner), "hf_to_vllm_mapper", None)
        self._seen: list[tuple[str, int, str | None, torch.Tensor]] = []  # (param, layer, shard, tensor)
        self._covered: set[tuple[str, int, str | None]] = set()
        self.unplaced: list[str] = []
        self._kv_names = [0, 0]  # K/V-like names of the current load_weights call: given, reaching the model

    @contextlib.contextmanager
    def attached(self, weights):
        """The draft's top-level stream, with the inner model's ``load_weights`` watched for
        the block: a K/V input the top-level stream names that never reaches the inner
        loader (a class that routes it elsewhere) counts as unplaced."""
        inner, original = self._inner, getattr(self._inner, "load_weights", None)
        self._kv_names = [0, 0]
        if original is not None:
            inner.load_weights = lambda stream: original(self.watch(stream))
        try:
            yield self._scan(weights)
        finally:
            if original is not None:
                del inner.load_weights
        if self._kv_names[0] and not self._kv_names[1]:
            self.unplaced.append(f"{self._kv_names[0]} K/V weight(s) that did not reach the draft's model loader")

    def _scan(self, weights):
        for name, tensor in weights:
            self._kv_names[0] += _KV_INPUT.search(name) is not None
            yield name, tensor

    def watch(self, weights):
        """The stream as the draft's model loader gets it, each tensor seen on the way."""
        for name, tensor in weights:
            self._kv_names[1] += _KV_INPUT.search(name) is not None
            self._see(name, tensor)
            yield name, tensor

    def _see(self, name: str, tensor: torch.Tensor) -> None:
        mapped = self._mapper._map_name_with_shard(name) if self._mapper is not None else (name, None)
        if mapped is None:
            return
        param, shard = mapped
        found = None
        if param == "hidden_norm.weight":
            found = ("hidden_norm", 0, None)
        elif (m := _K_NORM_PARAM.match(param)) is not None:
            found = ("k_norm", int(m[1]), None)
        elif (m := _INPUT_NORM_PARAM.match(param)) is not None:
            found = ("input_norm", int(m[1]), None)
        elif (m := _QKV_PARAM.match(param)) is not None and shard in ("k", "v", None):
            found = (m[2], int(m[1]), shard)
        elif (m := _QKV_PARAM.match(param)) is not None and shard == "q":
            return  # the Q rows: not the precompute's
        if found is None:
            if _KV_INPUT.search(param + ".") is not None:
                self.unplaced.append(name)
            return
        self._seen.append((*found, tensor))

    def covers(self, held: ContextKVWeights) -> bool:
        """Whether the update named every tensor ``held`` takes from the draft: every
        layer's K and V rows (and bias), its K norm, and the hidden norm(s)."""
        c = self._covered
        for layer in range(held.num_layers):
            kinds = ("weight", "bias") if held.kv_bias is not None else ("weight",)
            for kind in kinds:
                if (kind, layer, None) not in c and not {(kind, layer, "k"), (kind, layer, "v")} <= c:
                    return False
            if ("k_norm", layer, None) not in c:
                return False
            if held.per_layer_hidden_norm and ("input_norm", layer, None) not in c:
                return False
        return held.per_layer_hidden_norm or ("hidden_norm", 0, None) in c

    def refill(self, held: ContextKVWeights) -> str | None:
        """Write what the stream held since the last call into ``held``'s tensors in place;
        why not (nothing written) if a tensor does not fit. A quantized draft's streamed K/V
        tensors replace their shard's checkpoint-layout tensors and its rows are dequantized again."""
        seen, self._seen = self._seen, []
        source = getattr(self._inner, QUANTIZED_KV, None)
        writes, updated = [], {}  # updated: (layer, shard) -> that shard's tensors after the reload
        for kind, layer, shard, tensor in seen:
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
            elif source is not None and kind != "bias":
                if (why := self._quantized_update(source, updated, layer, shard, kind, tensor)) is not None:
                    return why
            elif kind in ("weight", "bias"):
                found = self._kv_writes(held, kind, layer, shard, tensor)
                if isinstance(found, str):
                    return found
                writes.extend(found)
        rows = held.num_kv_heads * held.head_dim
        for (layer, shard), tensors in updated.items():
            start = (2 * layer + (shard == "v")) * rows
            if held.quantized:  # fp8 rows held as they are: the new codes and scales
                found = source.fp8_shard(layer, shard, rows, tensors, held.dtype)
                if found is None:
                    return "the reloaded K/V tensors are no longer fp8 rows with per-tensor or per-channel scales"
                writes += [(held.kv_weight.view(torch.uint8)[start:start + rows], found[0].view(torch.uint8)),
                           (held.kv_weight_scale[start:start + rows], found[1])]
                continue
            try:
                writes.append((held.kv_weight[start:start + rows], source.readers[layer](tensors)))
            except (KeyError, IndexError, ValueError, RuntimeError) as exc:  # never fail vLLM's reload
                return f"the reloaded K/V tensors do not dequantize ({type(exc).__name__}: {exc})"
        for dst, src in writes:
            if dst.shape != src.shape:
                return f"a reloaded tensor of shape {list(src.shape)} does not fit {list(dst.shape)}"
        with torch.no_grad():
            for (layer, shard), tensors in updated.items():
                source.shards[layer][shard] = tensors
            for dst, src in writes:
                dst.copy_(src)
        self._covered.update((kind, layer, shard) for kind, layer, shard, _ in seen)
        return None

    def _quantized_update(self, source, updated: dict, layer: int, shard: str | None, kind: str,
                          tensor: torch.Tensor) -> str | None:
        """Put a streamed tensor of a quantized ``qkv_proj`` into ``updated``'s copies of
        its shards' tensors: a ``k``/``v`` shard's narrowed to this rank's heads along the
        parameter's ``output_dim``; a fused ``qkv`` tensor (Laguna) carved into K and V on one
        rank. Why not, if it cannot be placed."""
        attn = self._inner.layers[layer].self_attn
        qkv = attn.qkv_proj
        if kind not in source.shards[layer]["k"]:
            return f"the reload brings {kind}, which the loaded draft's K/V projection does not hold"
        held = source.shards[layer]["k"][kind]
        if shard is None:
            if getattr(qkv, "tp_size", 1) != 1:
                return "the reload brings a fused qkv_proj under tensor parallelism"
            rows = attn.num_kv_heads * attn.head_dim
            for name, start in (("k", attn.q_size), ("v", attn.q_size + rows)):
                try:
                    carved = quantized.shard_tensors(qkv, start, start + rows, {kind: tensor.to(held.device)},
                                                     source.dims[layer])
                except ValueError as exc:  # per-shard scales of another count
                    return f"the reload's layers.{layer}.self_attn.qkv_proj.{kind} does not fit ({exc})"
                if isinstance(carved, str):
                    return carved
                fitted = _fitted(f"layers.{layer}.self_attn.qkv_proj.{kind} ({name} rows)", carved[kind],
                                 source.shards[layer][name][kind])
                if isinstance(fitted, str):
                    return fitted
                updated.setdefault((layer, name), dict(source.shards[layer][name]))[kind] = fitted
            return None
        name = f"layers.{layer}.self_attn.{shard}_proj.{kind}"
        held = source.shards[layer][shard][kind]
        dim = source.dims[layer][kind]
        if dim is not None and tensor.dim() > dim and tensor.shape[dim] != held.shape[dim]:
            whole = held.shape[dim] * _ranks_of_heads(qkv)
            if tensor.shape[dim] != whole:
                return (f"the reload's {name} has {tensor.shape[dim]} rows along its output dimension; expected "
                        f"{whole} (the checkpoint's) or {held.shape[dim]} (this rank's)")
            rank = getattr(qkv, "tp_rank", 0) // getattr(qkv, "num_kv_head_replicas", 1)
            tensor = tensor.narrow(dim, rank * held.shape[dim], held.shape[dim])
        fitted = _fitted(name, tensor, held)
        if isinstance(fitted, str):
            return fitted
        updated.setdefault((layer, shard), dict(source.shards[layer][shard]))[kind] = fitted
        return None

    def _kv_writes(self, held: ContextKVWeights, kind: str, layer: int, shard: str | None, tensor: torch.Tensor):
        """Where a layer's K and V rows of a streamed ``qkv_proj`` tensor go (this rank's
        heads): a ``k``/``v`` shard, or a fused ``qkv`` tensor (Laguna's checkpoints) on one rank."""
        rows = held.num_kv_heads * held.head_dim
        target = held.kv_weight if kind == "weight" else held.kv_bias
        if target is None:
            return "the reload brings a K/V bias the loaded draft did not have"
        attn = self._inner.layers[layer].self_attn
        qkv = attn.qkv_proj
        start = 2 * layer * rows
        name = f"layers.{layer}.self_attn.{'qkv' if shard is None else shard}_proj.{kind}"
        if _number_kind(tensor.dtype) != "float":
            return f"the reload's {name} is {tensor.dtype}; the loaded draft holds float K/V rows"
        given = tensor.shape[0] if tensor.dim() else 0
        if shard is None:
            if getattr(qkv, "tp_size", 1) != 1:
                return "the reload brings a fused qkv_proj under tensor parallelism"
            if given != attn.q_size + 2 * rows:
                return (f"the reload's {name} has {given} rows; expected its layer's {attn.q_size} Q rows and "
                        f"{2 * rows} K and V rows")
            return [(target[start:start + 2 * rows], tensor.narrow(0, attn.q_size, 2 * rows))]
        start += (shard == "v") * rows
        sharded = getattr(getattr(qkv, kind, None), "is_sharded_weight", False)  # this rank's rows already
        expected = rows if sharded else rows * _ranks_of_heads(qkv)
        if given != expected:
            return (f"the reload's {name} has {given} rows; expected {expected} "
                    f"({'this rank' if sharded else 'the checkpoint'}'s K/V heads x head size)")
        if sharded:
            return [(target[start:start + rows], tensor)]
        rank = getattr(qkv, "tp_rank", 0) // getattr(qkv, "num_kv_head_replicas", 1)
        return [(target[start:start + rows], tensor.narrow(0, rank * rows, rows))]


def _ranks_of_heads(qkv) -> int:
    """How many ranks' K/V heads a checkpoint's K/V tensor holds (tensor-parallel ranks
    over the replicas of each head)."""
    return max(getattr(qkv, "tp_size", 1) // getattr(qkv, "num_kv_head_replicas", 1), 1)


_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _number_kind(dtype: torch.dtype) -> object:
    """What a streamed tensor's values are: "float" for float16/bfloat16/float32/float64
    (vLLM's loaders copy one into another), else the dtype itself (fp8 codes, packed or plain
    integers: read by their bits, so no other dtype stands for them; e8m0 scales streamed as
    ``float8_e8m0fnu`` are the uint8 exponents vLLM holds)."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return "float"
    return torch.uint8 if dtype == _E8M0 else dtype


def _fitted(name: str, tensor: torch.Tensor, held: torch.Tensor) -> torch.Tensor | str:
    """A streamed tensor of a quantized shard as the held one's shape, dtype and device, or
    why it cannot stand for it (another kind of number, another number of elements)."""
    if _number_kind(tensor.dtype) != _number_kind(held.dtype):
        return f"the reload's {name} is {tensor.dtype}; the loaded draft holds {held.dtype}"
    if tensor.numel() != held.numel():
        return f"the reload's {name} of shape {list(tensor.shape)} does not fit this rank's {list(held.shape)}"
    tensor = tensor.reshape(held.shape).to(held.device)
    return tensor.to(held.dtype) if _number_kind(held.dtype) == "float" else tensor.view(held.dtype)
