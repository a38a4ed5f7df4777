"""ContextKVWeights from DFlash draft checkpoints, and the RoPE tables."""

import json

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
