"""ContextKVWeights from DFlash draft checkpoints, and the RoPE tables."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

import dflash_rocm
from dflash_rocm.rope import build_cos_sin_cache


def write_draft(path, *, layers=2, heads=4, kv_heads=2, head_dim=8, hidden=16, names=None, config=None,
                bias=False):
    g = torch.Generator().manual_seed(0)
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": head_dim, "rms_norm_eps": 1e-5, "rope_theta": 5000.0, "max_position_embeddings": 64,
           "attention_bias": bias, "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1]}}
    cfg.update(config or {})
    tensors = {"hidden_norm.weight": torch.randn(hidden, generator=g), "fc.weight": torch.randn(hidden, hidden)}
    for i in range(layers):
        p = f"layers.{i}.self_attn."
        tensors[p + "q_proj.weight"] = torch.randn(heads * head_dim, hidden, generator=g)
        tensors[p + "k_proj.weight"] = torch.randn(kv_heads * head_dim, hidden, generator=g)
        tensors[p + "v_proj.weight"] = torch.randn(kv_heads * head_dim, hidden, generator=g)
        tensors[p + "k_norm.weight"] = torch.randn(head_dim, generator=g)
        if bias:
            tensors[p + "k_proj.bias"] = torch.randn(kv_heads * head_dim, generator=g)
            tensors[p + "v_proj.bias"] = torch.randn(kv_heads * head_dim, generator=g)
    if names:
        tensors = {names(k): v for k, v in tensors.items()}
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def test_from_checkpoint_stacks_layers_in_spec_order(tmp_path):
    tensors = write_draft(tmp_path, bias=True)
    w = dflash_rocm.load_context_kv_weights(tmp_path)
    assert (w.num_layers, w.num_kv_heads, w.head_dim, w.hidden_size) == (2, 2, 8, 16)
    expected = torch.cat([tensors["layers.0.self_attn.k_proj.weight"], tensors["layers.0.self_attn.v_proj.weight"],
                          tensors["layers.1.self_attn.k_proj.weight"], tensors["layers.1.self_attn.v_proj.weight"]])
    assert torch.equal(w.kv_weight, expected)
    assert torch.equal(w.kv_bias[16:32], tensors["layers.0.self_attn.v_proj.bias"])
    assert torch.equal(w.k_norm_weight[1], tensors["layers.1.self_attn.k_norm.weight"])
    assert torch.equal(w.hidden_norm_weight, tensors["hidden_norm.weight"])
    assert w.eps == 1e-5 and w.is_neox and w.v_scale is None
    assert torch.allclose(w.cos_sin_cache, build_cos_sin_cache(8, 64, {"rope_theta": 5000.0}))


def test_from_checkpoint_reads_partial_rotary_value_scale_and_dtype(tmp_path):
    write_draft(tmp_path, config={"partial_rotary_factor": 0.5, "is_neox_style": False,
                                  "dflash_config": {"attention_value_scale": 0.25}})
    w = dflash_rocm.load_context_kv_weights(tmp_path, dtype=torch.bfloat16)
    assert w.rotary_dim == 4 and not w.is_neox and w.v_scale == 0.25
    assert w.kv_weight.dtype == torch.bfloat16 and w.cos_sin_cache.dtype == torch.float32


def test_from_checkpoint_reads_nope_layers_and_beams_rounding(tmp_path):
    """A DFlash2 draft's ``no_rope_layers`` (vLLM serves it as Ricursive) are the layers whose
    K is not rotated; a Beam DFlash2 draft rounds the normed K before RoPE; a plain draft
    neither."""
    write_draft(tmp_path / "plain", layers=3)
    w = dflash_rocm.load_context_kv_weights(tmp_path / "plain")
    assert w.rope_layers is None and not w.round_k_before_rope
    write_draft(tmp_path / "ricursive", layers=3,
                config={"architectures": ["DFlash2DraftModel"], "no_rope_layers": [0, 2]})
    assert dflash_rocm.load_context_kv_weights(tmp_path / "ricursive").rope_layers == (False, True, False)
    write_draft(tmp_path / "beam", layers=3, config={"architectures": ["DFlash2BeamDraftModel"]})
    assert dflash_rocm.load_context_kv_weights(tmp_path / "beam").round_k_before_rope


def test_from_layers_stacks_per_layer_hidden_norms_and_keeps_the_variants():
    """Laguna's per-layer input norms stack to ``[L, H]``; the variant flags pass through."""
    g = torch.Generator().manual_seed(1)
    norms = [torch.randn(16, generator=g) for _ in range(2)]
    w = dflash_rocm.ContextKVWeights.from_layers(
        hidden_norm_weight=norms, k_proj_weights=[torch.randn(8, 16, generator=g) for _ in range(2)],
        v_proj_weights=[torch.randn(8, 16, generator=g) for _ in range(2)],
        k_norm_weights=[torch.ones(8), torch.ones(8)], cos_sin_cache=build_cos_sin_cache(8, 32, {"rope_theta": 1e4}),
        is_neox=True, eps=1e-6, num_kv_heads=1, head_dim=8, rope_layers=[True, False], round_k_before_rope=True)
    assert torch.equal(w.hidden_norm_weight, torch.stack(norms)) and w.per_layer_hidden_norm
    assert w.rope_layers == (True, False) and w.nope_layers == (1,) and w.round_k_before_rope


def test_midlayer_prefix_of_older_drafts_is_layer_zero(tmp_path):
    tensors = write_draft(tmp_path, layers=1, names=lambda k: k.replace("layers.0.", "midlayer."))
    w = dflash_rocm.load_context_kv_weights(tmp_path)
    assert torch.equal(w.kv_weight[:16], tensors["midlayer.self_attn.k_proj.weight"])


def test_missing_tensors_are_named(tmp_path):
    write_draft(tmp_path, names=lambda k: k.replace("layers.1.self_attn.v_proj", "layers.1.self_attn.vv"))
    with pytest.raises(ValueError, match=r"missing tensors layers\.1\.self_attn\.v_proj\.weight"):
        dflash_rocm.load_context_kv_weights(tmp_path)


def test_a_target_model_is_not_a_draft(tmp_path):
    write_draft(tmp_path, config={"architectures": ["Qwen3ForCausalLM"], "dflash_config": None})
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["dflash_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not a DFlash draft"):
        dflash_rocm.load_context_kv_weights(tmp_path)


def test_empty_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        dflash_rocm.load_context_kv_weights(tmp_path)


def test_unknown_rope_type_is_refused():
    with pytest.raises(ValueError, match="not supported"):
        build_cos_sin_cache(8, 16, {"rope_type": "mystery"})


ROPE_CASES = [
    {"rope_theta": 10000.0},
    {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0},
    {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
]


@pytest.mark.vllm
@pytest.mark.parametrize("params", ROPE_CASES, ids=lambda p: p.get("rope_type", "default"))
def test_rope_table_equals_vllms(params):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(16, max_position=128, is_neox_style=True, rope_parameters=dict(params),
                        dtype=torch.float32)
    ours = build_cos_sin_cache(16, 128, params)
    assert ours.shape == rope.cos_sin_cache.shape
    assert torch.allclose(ours, rope.cos_sin_cache.float(), atol=1e-5)


# -- what cannot be served is refused, naming the file and tensor (issue 16) ---------------------

from safetensors.torch import load_file  # noqa: E402

from dflash_rocm.rope import MAX_ROPE_POSITIONS  # noqa: E402

K0 = "layers.0.self_attn.k_proj.weight"


def edit_tensors(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def set_tensor(name, make):
    def edit(tensors):
        tensors[name] = make(tensors[name])
    return edit


@pytest.mark.parametrize("name,dtype", [
    (K0, torch.int8), ("layers.1.self_attn.v_proj.weight", torch.int8), (K0, torch.float8_e4m3fn),
    ("layers.0.self_attn.k_norm.weight", torch.int32), ("hidden_norm.weight", torch.uint8)])
def test_quantised_or_integer_weights_are_refused(tmp_path, name, dtype):
    write_draft(tmp_path)
    edit_tensors(tmp_path, set_tensor(name, lambda t: t.to(dtype)))
    with pytest.raises(ValueError, match=rf"model\.safetensors.*{name}.*expected F16, BF16 or F32"):
        dflash_rocm.load_context_kv_weights(tmp_path)


@pytest.mark.parametrize("name,shape", [
    (K0, (16, 8)), ("layers.1.self_attn.v_proj.weight", (8, 16)), ("layers.1.self_attn.k_norm.weight", (4,)),
    ("hidden_norm.weight", (16, 1)), ("layers.0.self_attn.k_proj.bias", (15,))])
def test_wrong_shapes_are_refused_with_the_expected_shape(tmp_path, name, shape):
    write_draft(tmp_path, bias=True)
    edit_tensors(tmp_path, set_tensor(name, lambda t: torch.zeros(shape)))
    with pytest.raises(ValueError, match=re.escape(f"{name} has shape {list(shape)}, expected")):
        dflash_rocm.load_context_kv_weights(tmp_path)


@pytest.mark.parametrize("cut", ["empty", "header length", "half the header", "half the data", "last byte",
                                 "garbled header"])
def test_truncated_or_corrupt_files_are_refused_naming_the_file(tmp_path, cut):
    write_draft(tmp_path)
    file = tmp_path / "model.safetensors"
    data = bytearray(file.read_bytes())
    header = int.from_bytes(data[:8], "little")
    cuts = {"empty": 0, "header length": 8, "half the header": 8 + header // 2,
            "half the data": (8 + header + len(data)) // 2, "last byte": len(data) - 1}
    if cut == "garbled header":
        data[8:24] = b"\xff" * 16
    else:
        data = data[:cuts[cut]]
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors' is not a readable safetensors file"):
        dflash_rocm.load_context_kv_weights(tmp_path)


def test_an_unreadable_file_is_refused_naming_it(tmp_path):
    write_draft(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"model\.safetensors' is not a readable safetensors file"):
        dflash_rocm.load_context_kv_weights(tmp_path)


def test_non_finite_weights_are_refused(tmp_path):
    write_draft(tmp_path)
    edit_tensors(tmp_path, set_tensor(K0, lambda t: t.index_fill(0, torch.tensor([3]), float("nan"))))
    with pytest.raises(ValueError, match=rf"{K0} holds NaN or Inf"):
        dflash_rocm.load_context_kv_weights(tmp_path)


@pytest.mark.parametrize("changes,words", [
    ({"max_position_embeddings": 10 ** 9}, "RoPE table would have 1000000000 positions"),
    ({"max_position_embeddings": 1e9}, "max_position_embeddings must be a positive int"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 1e6}}, "RoPE table would have"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 1e5, "original_max_position_embeddings": 1e5}},
     "RoPE table would have"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"rope_theta": 1.0}, "rope_theta: expected a number > 1"),
    ({"rope_theta": "big"}, "rope_theta: expected a positive number"),
    ({"rope_scaling": "yarn"}, "rope_scaling must be an object"),
    ({"partial_rotary_factor": 0.1}, "rotary dim 0"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ({"head_dim": 0}, "head_dim must be a positive int, got 0"),
    ({"head_dim": None, "hidden_size": 18}, "hidden_size 18 is not a multiple"),
    ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive int, got -1"),
    ({"num_hidden_layers": 10 ** 9}, "is not a draft's"),
    ({"num_attention_heads": True}, "num_attention_heads must be a positive int, got True"),
    ({"hidden_size": "16"}, "hidden_size must be a positive int, got '16'"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be positive"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps must be a finite number"),
    ({"attention_bias": "yes"}, "attention_bias must be true or false"),
    ({"is_neox_style": 1}, "is_neox_style must be true or false"),
    ({"dflash_config": {"attention_value_scale": "half"}}, "attention_value_scale must be a finite number"),
    ({"dflash_config": [1]}, "dflash_config must be an object"),
    ({"no_rope_layers": [2]}, "no_rope_layers must be a list of layer indices in [0, num_hidden_layers=2)"),
    ({"no_rope_layers": [True]}, "no_rope_layers must be a list of layer indices"),
    ({"no_rope_layers": "0"}, "no_rope_layers must be a list of layer indices"),
])
def test_absurd_config_values_are_refused_naming_config_json(tmp_path, changes, words):
    write_draft(tmp_path)
    edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match="config.json") as info:
        dflash_rocm.load_context_kv_weights(tmp_path)
    assert words in str(info.value)


def test_the_rope_table_length_is_bounded_before_allocating():
    with pytest.raises(ValueError, match=f"refused above {MAX_ROPE_POSITIONS}"):
        build_cos_sin_cache(128, MAX_ROPE_POSITIONS + 1, {"rope_theta": 1e6})
    with pytest.raises(ValueError, match="max_position: expected a positive int"):
        build_cos_sin_cache(128, 0)


@pytest.mark.parametrize("text,words", [("[1, 2]", "expected a JSON object, got a list"),
                                        ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),
                                        ('{"a": ', "is not valid JSON"),
                                        (json.dumps({"architectures": "DFlashDraftModel"}), "must be a list")])
def test_configs_that_are_not_draft_configs_are_refused(tmp_path, text, words):
    write_draft(tmp_path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=words):
        dflash_rocm.load_context_kv_weights(tmp_path)


def shard(path):
    """Split a written draft into two shards of needed tensors and a third of unneeded
    ones, with vLLM/HF's index file."""
    write_draft(path)
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    groups = {"model-00001-of-00003.safetensors": {k: v for k, v in tensors.items() if "layers.0" in k},
              "model-00002-of-00003.safetensors": {k: v for k, v in tensors.items()
                                                   if "layers.1" in k or k == "hidden_norm.weight"},
              "model-00003-of-00003.safetensors": {"fc.weight": tensors["fc.weight"]}}
    weight_map = {}
    for file, group in groups.items():
        save_file(group, str(path / file))
        weight_map.update({k: file for k in group})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def test_only_files_and_tensors_that_are_needed_are_read(tmp_path, monkeypatch):
    import safetensors

    tensors = shard(tmp_path)
    (tmp_path / "model-00003-of-00003.safetensors").write_bytes(b"not even a header")  # never opened
    read = []
    real = safetensors.safe_open

    class Recording:
        def __init__(self, file, framework):
            self.file, self.handle = file, real(file, framework=framework)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    w = dflash_rocm.load_context_kv_weights(tmp_path)
    assert torch.equal(w.kv_weight[:16], tensors[K0])
    assert sorted(read) == sorted(k for k in tensors if "k_proj" in k or "v_proj" in k or "k_norm" in k
                                  or k == "hidden_norm.weight")


@pytest.mark.parametrize("weight_map,words", [
    ({"layers.0.self_attn.k_proj.weight": "../elsewhere.safetensors"}, "not a file of the checkpoint"),
    ([1, 2], "expected a weight_map"),
])
def test_a_bad_index_is_refused_naming_it(tmp_path, weight_map, words):
    shard(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=rf"index\.json.*{words}"):
        dflash_rocm.load_context_kv_weights(tmp_path)


def test_an_index_naming_a_missing_shard_is_refused_naming_the_shard(tmp_path):
    shard(tmp_path)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model-00002-of-00003\.safetensors' is not a readable"):
        dflash_rocm.load_context_kv_weights(tmp_path)


def test_an_index_naming_a_shard_that_lacks_the_tensor_is_refused_naming_all_three(tmp_path):
    shard(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][K0] = "model-00002-of-00003.safetensors"  # which holds layer 1's tensors
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"index '.*index\.json': tensor {re.escape(K0)} is in "
                                         r"'model-00002-of-00003\.safetensors', which does not hold it"):
        dflash_rocm.load_context_kv_weights(tmp_path)
