"""Compile the Triton kernels for real GPU targets on a machine without a GPU.

Triton's compiler runs without a device: ``triton.compile`` takes the kernel, a signature
and a ``GPUTarget`` and goes down to cubin (NVIDIA) or hsaco (AMD). The launches are
captured from the real host code (``run_draft_attention`` / ``run_precompute`` on CPU
tensors), so the compiled signatures, constexprs and launch options are exactly what a
GPU run would use. Run as a script (Triton must not be in interpreter mode):

    python tests/aot_compile.py  ->  one JSON line per compiled variant
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
          torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e4m3fnuz: "fp8e4b8",
          torch.uint8: "u8"}
TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64),
           "gfx950": GPUTarget("hip", "gfx950", 64), "gfx1100": GPUTarget("hip", "gfx1100", 32),
           "gfx1201": GPUTarget("hip", "gfx1201", 32)}


def capture(run, *args):
    """The (kernel, args, constexprs, options) of every launch ``run(*args)`` makes."""
    from dflash_rocm.backends.triton import attention, precompute

    launches = []

    def record(kernel, grid, config, *kargs, **constexprs):
        options = {}
        if config is not None:
            options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
            if config.waves_per_eu:
                options["waves_per_eu"] = config.waves_per_eu
        launches.append((kernel, kargs, constexprs, options))

    saved = attention.launch, precompute.launch
    attention.launch = precompute.launch = record
    try:
        run(*args)
    finally:
        attention.launch, precompute.launch = saved
    return launches


def compile_launch(kernel, kargs, constexprs, options, target):
    import inspect
    names = list(inspect.signature(kernel.fn).parameters)
    signature, values = {}, {}
    for name, value in zip(names, list(kargs) + [constexprs[n] for n in names[len(kargs):]]):
        if name in constexprs:
            signature[name] = "constexpr"
            values[(names.index(name),)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    opts = dict(options)
    if target.backend == "cuda":
        opts.pop("waves_per_eu", None)
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=values), target=target,
                              options=opts)
    return sorted(compiled.asm)


def variants():
    """(name, arch list, run, args) for every kernel path and table entry worth compiling."""
    sys.path.insert(0, os.path.dirname(__file__))
    from dflash_rocm.backends.rocm import tables
    from dflash_rocm.backends.triton.attention import attention_config_for, run_draft_attention
    from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig, PrecomputeLaunchConfig
    from dflash_rocm.backends.triton.precompute import run_precompute
    from dflash_rocm.platform import simulate_platform
    from dflash_rocm.ops.attention import attention_call
from dflash_rocm.ops.precompute import precompute_call
    from strategies import make_generator, make_weights
    from test_triton_backend import paged

    fp8_of = {"sm_90": torch.float8_e4m3fn, "gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn,
              "gfx1201": torch.float8_e4m3fn}
    out = []
    for arch in TARGETS:
        for dtype in (torch.bfloat16, torch.float16):
            for fp8 in (False, True):
                if fp8 and arch not in fp8_of:
                    continue
                args = list(paged([600], [16], Hk=2, G=4, D=128, block_size=16, dtype=dtype))
                if fp8:
                    args[1], args[2] = args[1].to(fp8_of[arch]), args[2].to(fp8_of[arch])
                for kwargs in (dict(), dict(causal=True, sliding_window=256, sinks=torch.zeros(8))):
                    call = attention_call(*args, **kwargs)
                    if arch.startswith("gfx"):
                        with simulate_platform(arch):
                            from dflash_rocm.backends import rocm
                            name, config = rocm.attention_config(call)
                    else:
                        name, config = "portable", attention_config_for(call)
                    if config.num_segments == 1:
                        config = AttentionLaunchConfig(**{**config.as_dict(), "num_segments": 2})
                    out.append((f"attention {name} {dtype} fp8={fp8} {sorted(kwargs)}", arch,
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
            call = precompute_call(torch.randn(20, 256).to(dtype), torch.arange(20), w, caches[:2], caches[2:],
                                   torch.arange(20), k_scales=[1.0, 1.0] if fp8 else None,
                                   v_scales=[1.0, 1.0] if fp8 else None, return_kv=True)
            if arch.startswith("gfx"):
                config = tables.precompute_config(arch, num_tokens=20, hidden=256, num_heads_total=8, head_dim=128)
                config = PrecomputeLaunchConfig(**{**config.as_dict(), "split_k": split})
            else:
                config = PrecomputeLaunchConfig(split_k=split)
            out.append((f"precompute {dtype} fp8={fp8} neox={neox} split_k={split}", arch,
                        lambda c=call, cfg=config: run_precompute(c, cfg)))
    return out


def main() -> int:
    failures = 0
    for name, arch, run in variants():
        for kernel, kargs, constexprs, options in capture(run):
            record = {"variant": name, "arch": arch, "kernel": kernel.__name__, "options": options}
            try:
                record["stages"] = compile_launch(kernel, kargs, constexprs, options, TARGETS[arch])
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
