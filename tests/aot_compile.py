"""Compile the Triton kernels for real GPU targets on a machine without a GPU.

Triton's compiler runs without a device: ``triton.compile`` takes the kernel, a signature
and a ``GPUTarget`` and goes down to cubin (NVIDIA) or hsaco (AMD). The launches are
captured from the real host code (``run_draft_attention`` / ``run_precompute`` on CPU
tensors, inside ``capture()``) and specialised by Triton's own binder, so the
compiled signatures, attributes, constexprs and options are exactly what a GPU launch
would use. ``dflash-rocm inspect`` audits the served shapes; this covers every feature
path (windows, sinks, causal, fp16, split-K, return_kv). Run as a script (Triton must not
be in interpreter mode):

    python tests/aot_compile.py  ->  one JSON line per compiled variant
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

TARGETS = ("sm_90", "gfx942", "gfx950", "gfx1100", "gfx1201")


def capture(run):
    """Every launch ``run()`` makes, recorded instead of launched."""
    from dflash_rocm.launches import capture

    with capture() as launches:
        run()
    return launches


def compile_launch(launch, arch):
    """Compile ``launch`` for ``arch`` with the specialisation Triton's launcher would give
    it (alignment/divisibility attributes, ``== 1`` constants, AMD buffer-op ranges)."""
    from dflash_rocm.audit.compiler import compile_specialisation, specialise
    from dflash_rocm.audit.targets import TARGETS as AUDIT_TARGETS

    return sorted(compile_specialisation(specialise(launch, AUDIT_TARGETS[arch])).asm)


def variants():
    """(name, arch, run) for every kernel path and table entry worth compiling."""
    sys.path.insert(0, os.path.dirname(__file__))
    from dflash_rocm.backends.rocm import tables
    from dflash_rocm.arch import arch_info
    from dflash_rocm.backends.triton.attention import attention_config_for, run_draft_attention
    from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig, PrecomputeLaunchConfig
    from dflash_rocm.backends.triton.precompute import run_precompute
    from dflash_rocm.planning import record_for
    from dflash_rocm.platform import platform_for, simulate_platform
    from dflash_rocm.ops.attention import attention_call
    from dflash_rocm.ops.precompute import precompute_call
    from strategies import make_generator, make_weights
    from test_triton_backend import paged

    fp8_of = {arch: arch_info(arch).fp8_dtype for arch in TARGETS if arch_info(arch).fp8_dtype is not None}
    out = []
    for arch in TARGETS:
        features = dict(causal=True, sliding_window=256, sinks=torch.zeros(8))
        # (dtype, fp8 cache, features, merge): every kernel path once per arch.
        for dtype, fp8, kwargs, merge in ((torch.bfloat16, False, {}, "last"),
                                          (torch.bfloat16, False, features, "launch"),
                                          (torch.float16, False, features, "tail"),
                                          (torch.bfloat16, True, {}, "launch")):
            if fp8 and arch not in fp8_of:
                continue
            args = list(paged([600], [16], Hk=2, G=4, D=128, block_size=16, dtype=dtype))
            if fp8:
                args[1], args[2] = args[1].to(fp8_of[arch]), args[2].to(fp8_of[arch])
            call = attention_call(*args, **kwargs)
            if arch.startswith("gfx"):
                with simulate_platform(arch):
                    from dflash_rocm.backends import rocm
                    name, config = rocm.attention_choice(*record_for("draft_attention", "rocm", call))
            else:
                name, config = "portable", attention_config_for(call, platform_for(call.device))
            config = AttentionLaunchConfig(**{**config.as_dict(), "num_segments": max(2, config.num_segments),
                                              "merge": merge})
            out.append((f"attention {name} {dtype} fp8={fp8} {sorted(kwargs)} merge={merge}", arch,
                        lambda c=call, cfg=config: run_draft_attention(c, cfg)))
        g = make_generator(0, "cpu")
        for dtype, fp8, neox, split in ((torch.bfloat16, False, True, 1), (torch.float16, False, False, 2),
                                        (torch.float16, True, False, 2)):
            if fp8 and arch not in fp8_of:
                continue
            w = make_weights(g, "cpu", L=2, Hk=2, D=128, H=256, R=64, is_neox=neox, bias=True, v_scale=0.5,
                             dtype=dtype)
            cache_dtype = fp8_of[arch] if fp8 else dtype
            caches = [torch.zeros(4, 16, 2, 128, dtype=cache_dtype) for _ in range(4)]
            states = torch.randn(20, 256).to(dtype)

            def call_with(weights):
                return precompute_call(states, torch.arange(20), weights, caches[:2], caches[2:], torch.arange(20),
                                       k_scales=[1.0, 1.0] if fp8 else None, v_scales=[1.0, 1.0] if fp8 else None,
                                       return_kv=True)
            call = call_with(w)
            if arch.startswith("gfx"):
                config = tables.precompute_config(arch, num_tokens=20, hidden=256, num_heads_total=8, head_dim=128)
                config = PrecomputeLaunchConfig(**{**config.as_dict(), "split_k": split})
            else:
                config = PrecomputeLaunchConfig(block_t=32, split_k=split)  # one token tile: split applies
            out.append((f"precompute {dtype} fp8={fp8} neox={neox} split_k={split}", arch,
                        lambda c=call, cfg=config: run_precompute(c, cfg)))
            if not fp8:  # the DFlash family's variants: a NoPE layer, the normed K rounded before RoPE
                variant = call_with(dataclasses.replace(w, rope_layers=(False, True), round_k_before_rope=True))
                out.append((f"precompute {dtype} neox={neox} split_k={split} nope+round_k", arch,
                            lambda c=variant, cfg=config: run_precompute(c, cfg)))
            if split == 1:  # a KV head's K and V in one program
                out.append((f"precompute {dtype} fp8={fp8} neox={neox} heads=2", arch,
                            lambda c=call, cfg=PrecomputeLaunchConfig(**{**config.as_dict(), "heads": 2}):
                            run_precompute(c, cfg)))
        if arch.startswith("gfx"):
            out += packed_variants(arch, fp8_of.get(arch))
    return out


def packed_variants(arch, fp8_dtype):
    """vLLM ROCM_ATTN's packed pages (x-packed K, plain or interleaved V; bf16 and fp8 where
    the target converts it): every kernel once, the merge kernel and a split precompute included."""
    from dflash_rocm.backends import rocm
    from dflash_rocm.backends.rocm import tables
    from dflash_rocm.backends.triton.attention import run_draft_attention
    from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig, PrecomputeLaunchConfig
    from dflash_rocm.backends.triton.precompute import run_precompute
    from dflash_rocm.ops.attention import attention_call
    from dflash_rocm.ops.precompute import precompute_call
    from dflash_rocm.planning import record_for
    from dflash_rocm.platform import simulate_platform
    from strategies import make_generator, make_weights, pack_caches
    from test_triton_backend import paged

    out = []
    for packing in ("rocm_attn", "rocm_attn_interleaved_v"):
        for cache_dtype in (torch.bfloat16, fp8_dtype):
            if cache_dtype is None:
                continue
            fp8 = cache_dtype != torch.bfloat16
            args = list(paged([600], [16], Hk=2, G=4, D=128, block_size=16, dtype=torch.bfloat16))
            args[1], args[2] = pack_caches(args[1].to(cache_dtype), args[2].to(cache_dtype), packing)
            call = attention_call(*args)
            with simulate_platform(arch):
                _, config = rocm.attention_choice(*record_for("draft_attention", "rocm", call))
            config = AttentionLaunchConfig(**{**config.as_dict(), "num_segments": max(2, config.num_segments),
                                              "merge": "launch"})
            out.append((f"attention {packing} fp8={fp8}", arch, lambda c=call, cfg=config: run_draft_attention(c, cfg)))
            w = make_weights(make_generator(0, "cpu"), "cpu", L=2, Hk=2, D=128, H=256, R=128, is_neox=True, bias=False,
                             v_scale=None, dtype=torch.bfloat16)
            caches = [pack_caches(torch.zeros(4, 16, 2, 128, dtype=cache_dtype),
                                  torch.zeros(4, 16, 2, 128, dtype=cache_dtype), packing) for _ in range(2)]
            call = precompute_call(torch.randn(20, 256).to(torch.bfloat16), torch.arange(20), w,
                                   [k for k, _ in caches], [v for _, v in caches], torch.arange(20),
                                   k_scales=[1.0, 1.0] if fp8 else None, v_scales=[1.0, 1.0] if fp8 else None)
            config = tables.precompute_config(arch, num_tokens=20, hidden=256, num_heads_total=8, head_dim=128)
            config = PrecomputeLaunchConfig(**{**config.as_dict(), "split_k": 2})
            out.append((f"precompute {packing} fp8={fp8} split_k=2", arch,
                        lambda c=call, cfg=config: run_precompute(c, cfg)))
    return out


def main() -> int:
    failures = 0
    for name, arch, run in variants():
        for launch in capture(run):
            record = {"variant": name, "arch": arch, "kernel": launch.name, "options": launch.options}
            try:
                record["stages"] = compile_launch(launch, arch)
                record["ok"] = True
            except Exception as exc:  # reported per variant; the caller decides
                failures += 1
                record["ok"] = False
                record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                record["trace"] = traceback.format_exc()[-3000:]
            print(json.dumps(record), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
