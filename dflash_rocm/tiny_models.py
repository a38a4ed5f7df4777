"""Tiny random models for vLLM's DFlash path on CPU: a Qwen3 target and a DFlash draft,
and drafts of the other members of vLLM's DFlash family (``write_dflash2``,
``write_muse_glimmer``, ``write_qwen3_dspark``, ``write_lilicorr``, ``write_laguna``): each
the DFlash draft plus what that member's vLLM class reads, for the same target.

Written on the fly (float32: a 3.3 MB target, a 1.3 MB draft to which a member adds at
most 170 KB) by the vLLM end-to-end tests and by ``dflash-rocm bench --vllm``, so neither
needs a download.

The target is almost a bigram model (lm_head reads dims 0-63); draft layer 0 makes every
mask slot attend to the bonus token through a marker direction in low-frequency RoPE
pairs, so the first proposal is usually next(bonus) and gets accepted, while its other
heads mix in position- and causality-dependent context: proposals vary from step to step
and change when causality, windows or the context K/V change. ``same_k_norm`` gives both
draft layers one k_norm weight (vLLM's CPU rms_norm applies row 0 of a grouped weight
to every layer, so only then is vLLM's own CPU path correct to compare against).
"""

import json
import os
from typing import NamedTuple

import torch
from safetensors.torch import save_file

HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
INTER = 256
VOCAB = 1000
TARGET_LAYERS = 4
DRAFT_LAYERS = 2
TARGET_LAYER_IDS = [1, 3]  # DFlash semantics: hidden state *after* layer i
SPECIALS = ["<unk>", "<pad>", "<eos>", "<mask>"]
MASK_ID = 3
EOS_ID = 2
ROPE_THETA = 1_000_000.0
MAX_POS = 2048


class Sizes(NamedTuple):
    """A target and draft's dimensions (one vocabulary, :data:`VOCAB`, for every size)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    target_layers: int
    draft_layers: int
    target_layer_ids: tuple[int, ...]  # DFlash semantics: hidden state *after* layer i


TINY = Sizes(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, inter=INTER,
             target_layers=TARGET_LAYERS, draft_layers=DRAFT_LAYERS, target_layer_ids=tuple(TARGET_LAYER_IDS))
# z-lab/Qwen3-8B-DFlash-b16's draft (dflash_rocm.workloads.SHAPES: hidden 4096, 32 query and 8 KV heads of 128,
# 5 layers; MLP 12288 and 5 target taps, fc [4096, 5 x 4096], as dflash_rocm.peer's step model has them) beside a
# target of Qwen3-8B's layer width cut to 5 layers (the real one has 36): the taps are its 5 layers, not the
# published ones. About 1 G parameters each (2 GB in bf16), so both fit a 24 GiB CPU machine.
DRAFT_SIZED = Sizes(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=12288, target_layers=5, draft_layers=5,
                    target_layer_ids=(0, 1, 2, 3, 4))


def make_tokenizer(out):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for i in range(len(SPECIALS), VOCAB):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tok.save(os.path.join(out, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "eos_token": "<eos>",
        "mask_token": "<mask>",
        "model_max_length": MAX_POS,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({k: v for k, v in cfg.items() if k.endswith("_token")}, f, indent=2)


def common_cfg(num_layers, sizes=TINY):
    return {
        "model_type": "qwen3",
        "hidden_size": sizes.hidden,
        "intermediate_size": sizes.inter,
        "num_hidden_layers": num_layers,
        "num_attention_heads": sizes.heads,
        "num_key_value_heads": sizes.kv_heads,
        "head_dim": sizes.head_dim,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "max_position_embeddings": MAX_POS,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": 1,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def rand(g, *shape, std=1.0):
    return torch.randn(*shape, generator=g) * std


def make_target(out, g, m, n):
    os.makedirs(out, exist_ok=True)
    R, M = slice(0, 64), slice(64, 128)
    w = {}
    emb = torch.zeros(VOCAB, HIDDEN)
    emb[:, R] = rand(g, VOCAB, 64)
    emb[:, M] = m
    emb[MASK_ID, R] = 0.0
    emb[MASK_ID, M] = -m + n  # n: see make_draft (gives <mask> a non-zero value)
    w["model.embed_tokens.weight"] = emb
    lm = torch.zeros(VOCAB, HIDDEN)
    lm[:, R] = rand(g, VOCAB, 64)
    lm[: len(SPECIALS)] = 0.0  # never generate special tokens
    w["lm_head.weight"] = lm
    for i in range(TARGET_LAYERS):
        w.update(random_layer(g, f"model.layers.{i}.", TINY))
    w["model.norm.weight"] = torch.ones(HIDDEN)
    write_target(out, w, TINY)


def random_layer(g, prefix, sizes, std=0.02, dtype=torch.float32):
    """One Qwen3 decoder layer's weights: random projections, unit norms."""
    H, inner, kv = sizes.hidden, sizes.heads * sizes.head_dim, sizes.kv_heads * sizes.head_dim

    def r(*shape):
        return rand(g, *shape, std=std).to(dtype)

    return {prefix + "self_attn.q_proj.weight": r(inner, H), prefix + "self_attn.k_proj.weight": r(kv, H),
            prefix + "self_attn.v_proj.weight": r(kv, H), prefix + "self_attn.o_proj.weight": r(H, inner),
            prefix + "self_attn.q_norm.weight": torch.ones(sizes.head_dim, dtype=dtype),
            prefix + "self_attn.k_norm.weight": torch.ones(sizes.head_dim, dtype=dtype),
            prefix + "mlp.gate_proj.weight": r(sizes.inter, H), prefix + "mlp.up_proj.weight": r(sizes.inter, H),
            prefix + "mlp.down_proj.weight": r(H, sizes.inter),
            prefix + "input_layernorm.weight": torch.ones(H, dtype=dtype),
            prefix + "post_attention_layernorm.weight": torch.ones(H, dtype=dtype)}


def write_target(out, w, sizes):
    """The target's weights ``w``, its config, generation config and tokenizer into ``out``."""
    save_file({k: v.contiguous() for k, v in w.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = common_cfg(sizes.target_layers, sizes)
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": EOS_ID, "pad_token_id": 1}, f)
    make_tokenizer(out)


def write_draft(out, w, sizes):
    """The DFlash draft's weights ``w`` and config into ``out``."""
    save_file({k: v.contiguous() for k, v in w.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = common_cfg(sizes.draft_layers, sizes)
    cfg["architectures"] = ["DFlashDraftModel"]
    cfg["dflash_config"] = {"mask_token_id": MASK_ID,
                            "target_layer_ids": list(sizes.target_layer_ids)}
    cfg["num_target_layers"] = sizes.target_layers
    cfg["block_size"] = 8  # informational (real DFlash ckpts carry it); vLLM uses
    #                        speculative_config.num_speculative_tokens
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def make_draft(out, g, m, n, AB, leak=0.1, same_k_norm=False):
    os.makedirs(out, exist_ok=True)
    M = slice(64, 128)
    w = {}
    s = 0.02
    for i in range(DRAFT_LAYERS):
        p = f"layers.{i}."
        q = rand(g, HEADS * HEAD_DIM, HIDDEN, std=s)
        k = rand(g, KV_HEADS * HEAD_DIM, HIDDEN, std=s)
        v = rand(g, KV_HEADS * HEAD_DIM, HIDDEN, std=s)
        o = rand(g, HIDDEN, HEADS * HEAD_DIM, std=s)
        qn = torch.ones(HEAD_DIM)
        if i == 0:
            q = rand(g, HEADS * HEAD_DIM, HIDDEN, std=0.1)
            k.zero_()
            v.zero_()
            o.zero_()
            A, B = AB
            for h in range(KV_HEADS):
                kh = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
                k[kh, M] = A + B  # key: marker direction (low + high RoPE pairs)
                # q head 2h: <mask> query ~ +A m  -> attends the bonus token
                qh = 2 * h
                q[qh * HEAD_DIM:(qh + 1) * HEAD_DIM] = 0.0
                q[qh * HEAD_DIM:(qh + 1) * HEAD_DIM, M] = -A
                # q head 2h+1: <mask> query ~ phase-rotated high part of a <mask>
                # key -> attends the other <mask> slots with RoPE-(relative
                # offset-)dependent, asymmetric weights => position-dependent and
                # causality-sensitive output (V(<mask>) != 0 via its R dims).
                qh1 = 2 * h + 1
                Bq = B.clone()
                for j in range(8):  # rotate each high-frequency neox pair (j, j+16)
                    th = 0.9 + 0.3 * j
                    c, s_ = torch.cos(torch.tensor(th)), torch.sin(torch.tensor(th))
                    Bq[j], Bq[j + 16] = c * B[j] - s_ * B[j + 16], s_ * B[j] + c * B[j + 16]
                q[qh1 * HEAD_DIM:(qh1 + 1) * HEAD_DIM] = 0.0
                q[qh1 * HEAD_DIM:(qh1 + 1) * HEAD_DIM, M] = Bq  # x_mask[M] = -m
                # V head h copies R dims [32h, 32h+32); plus a rank-1 read of the
                # n direction (zero for normal tokens since n is orthogonal to m)
                v[kh, h * 32:(h + 1) * 32] = torch.eye(32)
                v[kh, M] = torch.outer(rand(g, HEAD_DIM), n / n.dot(n))
                # o_proj: q head 2h output -> R dims [32h, 32h+32)
                o[h * 32:(h + 1) * 32, qh * HEAD_DIM:(qh + 1) * HEAD_DIM] = 1.5 * torch.eye(32)
                # q head 2h+1 output -> R dims through a random matrix
                o[0:64, qh1 * HEAD_DIM:(qh1 + 1) * HEAD_DIM] = rand(g, 64, HEAD_DIM, std=leak)
            qn = torch.full((HEAD_DIM,), 4.0)  # sharpen the mask->bonus attention
        w[p + "self_attn.q_proj.weight"] = q
        w[p + "self_attn.k_proj.weight"] = k
        w[p + "self_attn.v_proj.weight"] = v
        w[p + "self_attn.o_proj.weight"] = o
        w[p + "self_attn.q_norm.weight"] = qn
        # distinct per-layer k_norm weights exercise the grouped K-RMSNorm
        # (ops.rms_norm with a [num_layers, head_dim] weight) of the precompute
        layer_k_norm = 0.5 + torch.rand(HEAD_DIM, generator=g)
        w[p + "self_attn.k_norm.weight"] = (
            torch.ones(HEAD_DIM) if i == 0 or same_k_norm else layer_k_norm)
        w[p + "mlp.gate_proj.weight"] = rand(g, INTER, HIDDEN, std=s)
        w[p + "mlp.up_proj.weight"] = rand(g, INTER, HIDDEN, std=s)
        w[p + "mlp.down_proj.weight"] = rand(g, HIDDEN, INTER, std=s)
        w[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    # fc: [hidden, len(target_layer_ids) * target_hidden]; hidden_norm; final norm
    w["fc.weight"] = rand(g, HIDDEN, HIDDEN * len(TARGET_LAYER_IDS),
                          std=(HIDDEN * len(TARGET_LAYER_IDS)) ** -0.5)
    w["hidden_norm.weight"] = torch.ones(HIDDEN)
    w["norm.weight"] = torch.ones(HIDDEN)
    write_draft(out, w, TINY)


def write_models(out, *, seed=0, leak=0.1, same_k_norm=False, dflash_config=None, draft_config=None):
    """Write ``out/target`` and ``out/draft``; ``dflash_config`` entries are merged into
    the draft's (e.g. ``{"causal": True}`` or ``{"use_swa": True, "swa_window_size": 8}``),
    ``draft_config`` entries into its top level (e.g. ``architectures`` for another member
    of the DFlash family, or per-layer ``layer_types``)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(64, generator=g)
    low = list(range(8, 16)) + list(range(24, 32))
    high = list(range(0, 8)) + list(range(16, 24))
    A = torch.zeros(HEAD_DIM, 64)
    A[low] = torch.randn(len(low), 64, generator=g)
    B = torch.zeros(HEAD_DIM, 64)
    B[high] = torch.randn(len(high), 64, generator=g) * 0.7
    # n: orthogonal to m and to every row of A, B; it only feeds V(<mask>).
    basis = torch.cat([A[low], B[high], m[None]], 0)
    _, _, vh = torch.linalg.svd(basis)
    null = vh[basis.shape[0]:]
    n = null.t() @ torch.randn(null.shape[0], generator=g)
    n = n / n.norm() * m.norm()
    make_target(os.path.join(out, "target"), g, m, n)
    make_draft(os.path.join(out, "draft"), g, m, n, (A, B), leak, same_k_norm)
    if dflash_config or draft_config:
        path = os.path.join(out, "draft", "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg["dflash_config"].update(dflash_config or {})
        cfg.update(draft_config or {})
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)
    return os.path.join(out, "target"), os.path.join(out, "draft")


def write_random_models(out, sizes, *, seed=0):
    """Write ``out/target`` and ``out/draft`` at ``sizes`` with plain random bf16 weights
    (std 0.02 projections, unit norms; one K-norm weight for every draft layer, as vLLM's
    CPU path needs): no designed behaviour, so the draft's proposals are rarely accepted.
    For timing at real widths (``bench --vllm --size draft``), not for checking proposals."""
    g = torch.Generator().manual_seed(seed)
    H, dtype = sizes.hidden, torch.bfloat16
    target = {"model.embed_tokens.weight": rand(g, VOCAB, H).to(dtype),
              "lm_head.weight": rand(g, VOCAB, H, std=H ** -0.5).to(dtype),
              "model.norm.weight": torch.ones(H, dtype=dtype)}
    for i in range(sizes.target_layers):
        target.update(random_layer(g, f"model.layers.{i}.", sizes, dtype=dtype))
    os.makedirs(os.path.join(out, "target"), exist_ok=True)
    write_target(os.path.join(out, "target"), target, sizes)
    del target
    taps = len(sizes.target_layer_ids)
    draft = {"fc.weight": rand(g, H, H * taps, std=(H * taps) ** -0.5).to(dtype),
             "hidden_norm.weight": torch.ones(H, dtype=dtype), "norm.weight": torch.ones(H, dtype=dtype)}
    for i in range(sizes.draft_layers):
        draft.update(random_layer(g, f"layers.{i}.", sizes, dtype=dtype))
    os.makedirs(os.path.join(out, "draft"), exist_ok=True)
    write_draft(os.path.join(out, "draft"), draft, sizes)
    return os.path.join(out, "target"), os.path.join(out, "draft")


# -- other members of vLLM's DFlash family: the DFlash checkpoint plus what each member's class reads --

def rewrite_draft(draft, edit, seed):
    """Apply ``edit(tensors, generator)`` to the draft's checkpoint (in place)."""
    from safetensors.torch import load_file

    path = os.path.join(draft, "model.safetensors")
    tensors = load_file(path)
    edit(tensors, torch.Generator().manual_seed(seed + 1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})


CONV_TAPS, CONV_GROUP = 3, 32
DFLASH2_CONV = {"conv_kernel_size": CONV_TAPS, "conv_group_size": CONV_GROUP}


def _add_grouped_convs(w, g):
    """DFlash2's two grouped convolutions per layer: tap 0 near identity, the others and
    the per-token kernel projection small, so the draft stays close to the DFlash one."""
    for i in range(DRAFT_LAYERS):
        for conv in ("attention_conv", "mlp_conv"):
            base = rand(g, 2, CONV_TAPS, HIDDEN, std=0.05)
            base[:, 0] += 1.0
            w[f"layers.{i}.{conv}.base_kernel"] = base
            w[f"layers.{i}.{conv}.kernel_projection.weight"] = rand(
                g, 2 * CONV_TAPS * (HIDDEN // CONV_GROUP), HIDDEN, std=0.01)


def write_dflash2(out, *, seed=0, **kwargs):
    """A ``DFlash2DraftModel``: grouped convolutions around attention and MLP, and a
    candidate selector (low-rank predecessor/successor codebooks over the top k)."""
    rank = 8
    target, draft = write_models(out, seed=seed, draft_config={"architectures": ["DFlash2DraftModel"]},
                                 dflash_config={**DFLASH2_CONV, "selector_rank": rank, "selector_top_k": 4}, **kwargs)

    def edit(w, g):
        _add_grouped_convs(w, g)
        w["candidate_selector.predecessor_codebook"] = rand(g, VOCAB, rank, std=0.3)
        w["candidate_selector.successor_codebook"] = rand(g, VOCAB, rank, std=0.3)
        w["candidate_selector.hidden_projection.weight"] = rand(g, rank, HIDDEN, std=0.1)
    rewrite_draft(draft, edit, seed)
    return target, draft


def write_muse_glimmer(out, *, seed=0, **kwargs):
    """A ``MuseGlimmerAssistantModel``: DFlash's tensors, its context projection and norm
    named as Muse-Glimmer-30B-assistant names them (``encoder.fc``, ``encoder.output_norm_enc``)."""
    target, draft = write_models(out, seed=seed, draft_config={"architectures": ["MuseGlimmerAssistantModel"]},
                                 **kwargs)

    def edit(w, g):
        w["encoder.fc.weight"] = w.pop("fc.weight")
        w["encoder.output_norm_enc.weight"] = w.pop("hidden_norm.weight")
    rewrite_draft(draft, edit, seed)
    return target, draft


def write_qwen3_dspark(out, *, seed=0, **kwargs):
    """A ``Qwen3DSparkModel`` (speculative method ``dspark``): DFlash's backbone and a
    low-rank Markov head whose transition bias is added to the draft logits token by
    token; the anchor predicts the first draft token (``sample_from_anchor``)."""
    rank = 8
    target, draft = write_models(out, seed=seed, **kwargs, draft_config={
        "architectures": ["Qwen3DSparkModel"], "markov_rank": rank, "sample_from_anchor": True})

    def edit(w, g):
        w["markov_head.markov_w1.weight"] = rand(g, VOCAB, rank, std=0.3)
        w["markov_head.markov_w2.weight"] = rand(g, VOCAB, rank, std=0.3)
    rewrite_draft(draft, edit, seed)
    return target, draft


def write_lilicorr(out, *, seed=0, **kwargs):
    """A ``LiLiCorrDraftModel``: DFlash2's backbone (grouped convolutions) and the LiLiCorr
    correlator, a small transformer over the top-k candidate lattice scoring transitions."""
    hidden, heads, topk, factor, layers = 32, 2, 4, 16, 1
    block = 8  # the draft's trained block_size (write_models)
    target, draft = write_models(out, seed=seed, draft_config={"architectures": ["LiLiCorrDraftModel"]},
                                 dflash_config={
                                     **DFLASH2_CONV, "lilicorr_hidden_size": hidden, "lilicorr_candidate_topk": topk,
                                     "lilicorr_num_heads": heads, "lilicorr_mlp_ratio": 2.0,
                                     "lilicorr_factor_dim": factor, "lilicorr_vector_eps": 1e-6,
                                     "lilicorr_logit_scale": 8.0, "lilicorr_num_layers": layers}, **kwargs)

    def edit(w, g):
        def linear(name, fan_in, fan_out):
            w[f"{name}.weight"] = rand(g, fan_out, fan_in, std=fan_in ** -0.5)
            w[f"{name}.bias"] = rand(g, fan_out, std=0.02)

        _add_grouped_convs(w, g)
        h = "lilicorr."
        for name, fan_in, fan_out in (("token_proj", HIDDEN, hidden), ("pass_hidden_proj", HIDDEN, hidden),
                                      ("context_proj", HIDDEN, hidden), ("feature_mlp.up_proj", 5, hidden),
                                      ("feature_mlp.down_proj", hidden, hidden),
                                      ("factor_input_proj", 3 * hidden, hidden), ("out_head", hidden, factor),
                                      ("in_head", hidden, factor), ("anchor_out_head", hidden, factor)):
            linear(h + name, fan_in, fan_out)
        w[h + "feature_norm.weight"], w[h + "feature_norm.bias"] = torch.ones(5), torch.zeros(5)
        w[h + "slot_embedding"] = rand(g, 1, 1, block - 1, 1, hidden, std=0.1)
        w[h + "rank_embedding"] = rand(g, 1, 1, 1, topk, hidden, std=0.1)
        w[h + "relative_slot_bias"] = rand(g, heads, 2 * block - 1, std=0.1)
        w[h + "same_slot_bias"] = rand(g, heads, std=0.1)
        for i in range(layers):
            p = f"{h}layers.{i}."
            w[p + "attn_norm.weight"], w[p + "mlp_norm.weight"] = torch.ones(hidden), torch.ones(hidden)
            w[p + "attn.in_proj_weight"] = rand(g, 3 * hidden, hidden, std=hidden ** -0.5)
            w[p + "attn.in_proj_bias"] = rand(g, 3 * hidden, std=0.02)
            linear(p + "attn.out_proj", hidden, hidden)
            linear(p + "mlp.up_proj", hidden, 2 * hidden)
            linear(p + "mlp.down_proj", 2 * hidden, hidden)
        w[h + "output_norm.weight"], w[h + "anchor_norm.weight"] = torch.ones(hidden), torch.ones(hidden)
    rewrite_draft(draft, edit, seed)
    return target, draft


def write_laguna(out, *, seed=0, **kwargs):
    """A ``DFlashLagunaForCausalLM``: Laguna decoder layers (fused ``qkv_proj`` as Laguna
    checkpoints store it, dense MLPs, no gating), one RMSNorm per target hidden state
    before ``fc``, and distinct ``input_layernorm`` weights, which Laguna's precompute
    applies to the context per layer."""
    target, draft = write_models(out, seed=seed, draft_config={
        "architectures": ["DFlashLagunaForCausalLM"], "gating": False, "draft_vocab_size": VOCAB,
        "layer_types": ["full_attention"] * DRAFT_LAYERS, "mlp_layer_types": ["dense"] * DRAFT_LAYERS}, **kwargs)

    def edit(w, g):
        for i in range(DRAFT_LAYERS):
            p = f"layers.{i}."
            w[p + "self_attn.qkv_proj.weight"] = torch.cat([w.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            w[p + "input_layernorm.weight"] = 0.5 + torch.rand(HIDDEN, generator=g)
        for j in range(len(TARGET_LAYER_IDS)):
            w[f"aux_hidden_norms.{j}.weight"] = torch.ones(HIDDEN)
    rewrite_draft(draft, edit, seed)
    return target, draft
