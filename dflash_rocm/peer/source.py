"""Load vLLM's own Triton kernel files from a vLLM tree at run time, for one GPU target.

vLLM's kernel modules import a few of vLLM's own modules (its platform, logger, env
flags, ``triton_utils``) and read the platform when they are imported (``is_gfx1201``,
the fp8 format, block sizes). Importing the ``vllm`` package of the version read is not
possible here (another vLLM may be installed, or none), so each kernel file is loaded by
path under a private module name, while stand-ins for those few imports sit in
``sys.modules`` (put back as they were right after): a platform that reports the audit
target, a logger, ``VLLM_BATCH_INVARIANT`` off, and the kernel files' sibling modules
loaded the same way. The stand-ins answer only what these files ask; a vLLM whose
kernel files import more is refused with the name it asked for.

Nothing is copied: the kernels compiled are the functions defined by the files read.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import logging
import sys
import types
from pathlib import Path

from dflash_rocm.audit.targets import Target

ATTENTION_OPS = "vllm/v1/attention/ops"
# The kernel files, by short name, and the sibling modules each imports from vLLM.
FILES = {
    "helpers": f"{ATTENTION_OPS}/triton_attention_helpers.py",
    "unified": f"{ATTENTION_OPS}/triton_unified_attention.py",
    "prefix": f"{ATTENTION_OPS}/prefix_prefill.py",
    "paged": f"{ATTENTION_OPS}/chunked_prefill_paged_decode.py",
}
SIBLINGS = {"unified": ("helpers",), "paged": ("prefix",)}
# vLLM's import name of each sibling file (what the kernel files import it as).
IMPORT_NAMES = {"helpers": "vllm.v1.attention.ops.triton_attention_helpers",
                "prefix": "vllm.v1.attention.ops.prefix_prefill"}
# vLLM 0.34's device capabilities as its platforms report them (major, minor).
CAPABILITIES = {"gfx942": (9, 4), "gfx950": (9, 5), "gfx1100": (11, 0), "gfx1201": (12, 0), "sm_90": (9, 0)}


class KVQuantMode(enum.IntEnum):
    """vLLM 0.34's ``KVQuantMode`` values the attention launcher compares against
    (``vllm/v1/kv_cache_interface.py``; its module imports half of vLLM)."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4


class PeerPlatform:
    """``vllm.platforms.current_platform`` as the kernel files ask it, for ``target``."""

    def __init__(self, target: Target):
        self.target = target

    def is_rocm(self) -> bool:
        return self.target.amd

    def is_cuda(self) -> bool:
        return not self.target.amd

    def fp8_dtype(self):
        import torch

        return self.target.fp8_dtype or torch.float8_e4m3fn

    def get_device_capability(self) -> tuple[int, int]:
        return CAPABILITIES[self.target.arch]

    def has_device_capability(self, capability: int) -> bool:
        major, minor = self.get_device_capability()
        return major * 10 + minor >= capability

    def is_device_capability_family(self, family: int) -> bool:
        return self.get_device_capability()[0] * 10 == family

    def is_device_capability(self, capability) -> bool:
        return tuple(capability) == self.get_device_capability()


class PeerLogger(logging.LoggerAdapter):
    """vLLM's logger methods the kernel files call (``*_once``: logged every time here)."""

    def debug_once(self, msg, *args, **kwargs):
        self.debug(msg, *args)

    def info_once(self, msg, *args, **kwargs):
        self.info(msg, *args)

    def warning_once(self, msg, *args, **kwargs):
        self.debug(msg, *args)  # vLLM's fallback warnings are expected on meta tensors


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def _stand_ins(target: Target) -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    arch = target.arch
    platform = PeerPlatform(target)
    rocm = _module("vllm.platforms.rocm", on_gfx1100=lambda: arch == "gfx1100", on_gfx1201=lambda: arch == "gfx1201",
                   on_rdna=lambda: arch.startswith("gfx1"),
                   # the Triton decode kernel stands for vLLM's HIP paged-attention one (see compare.py)
                   use_rocm_custom_paged_attention=lambda *args, **kwargs: False)
    modules = {
        "vllm": _module("vllm", __path__=[]),
        "vllm.envs": _module("vllm.envs", VLLM_BATCH_INVARIANT=False),
        "vllm.logger": _module("vllm.logger", init_logger=lambda name: PeerLogger(logging.getLogger(name), {})),
        "vllm.platforms": _module("vllm.platforms", __path__=[], current_platform=platform),
        "vllm.platforms.rocm": rocm,
        "vllm.triton_utils": _module("vllm.triton_utils", tl=tl, triton=triton),
        "vllm._custom_ops": _module("vllm._custom_ops"),
        "vllm.v1": _module("vllm.v1", __path__=[]),
        "vllm.v1.attention": _module("vllm.v1.attention", __path__=[]),
        "vllm.v1.attention.ops": _module("vllm.v1.attention.ops", __path__=[]),
        "vllm.v1.kv_cache_interface": _module("vllm.v1.kv_cache_interface", KVQuantMode=KVQuantMode),
    }
    modules["vllm"].__dict__.update(envs=modules["vllm.envs"], _custom_ops=modules["vllm._custom_ops"])
    return modules


@contextlib.contextmanager
def _standing_in(modules: dict[str, types.ModuleType]):
    """``modules`` in ``sys.modules`` for the block; whatever was there before, after."""
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def resolve_tree(path: str) -> Path:
    """The folder holding ``vllm/`` for ``path``: an unpacked vLLM (the folder above
    ``vllm/``, or ``vllm/`` itself), or ``installed`` (the importable vLLM's). Refuses one
    without vLLM's unified-attention kernel file."""
    if path == "installed":
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("--peer installed: no vLLM is installed in this environment")
        root = Path(next(iter(spec.submodule_search_locations))).parent
    else:
        root = Path(path).expanduser()
        if root.name == "vllm" and (root / "__init__.py").exists():
            root = root.parent
    for name in ("unified", *SIBLINGS["unified"]):
        if not (root / FILES[name]).is_file():
            raise ValueError(f"--peer {path}: {root / FILES[name]} not found (give an unpacked vLLM tree: the "
                             "folder holding vllm/, e.g. from `pip download --no-deps vllm==0.34.0` and unzip)")
    return root


def module_name(root: Path, name: str, target: Target) -> str:
    """The private ``sys.modules`` name of kernel file ``name`` of ``root`` loaded for ``target``
    (the compiler imports a kernel's module by this name)."""
    tag = "".join(c if c.isalnum() else "_" for c in str(root.resolve()))[-60:]
    return f"_dflash_rocm_peer_{target.arch}_{name}_{tag}"


def load(root: Path, name: str, target: Target) -> types.ModuleType:
    """Kernel file ``name`` (a key of :data:`FILES`) of the vLLM tree ``root``, loaded as
    it is for ``target`` (once per process; its siblings first)."""
    private = module_name(root, name, target)
    if private in sys.modules:
        return sys.modules[private]
    siblings = {IMPORT_NAMES[s]: load(root, s, target) for s in SIBLINGS.get(name, ())}
    path = root / FILES[name]
    if not path.is_file():
        raise ValueError(f"--peer: {path} not found in this vLLM tree")
    spec = importlib.util.spec_from_file_location(private, path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "vllm.v1.attention.ops"  # its relative imports find the siblings stood in for
    sys.modules[private] = module  # as an import would: code run at load may look itself up
    with _standing_in({**_stand_ins(target), **siblings}):
        try:
            spec.loader.exec_module(module)
        except ImportError as exc:
            del sys.modules[private]
            raise ValueError(f"--peer: {path} imports {exc.name or exc}, which the loader does not stand in "
                             "for (a vLLM this tool does not know)") from None
        except BaseException:
            del sys.modules[private]  # a half-loaded module is never handed out later
            raise
    return module


def host_context(root: Path, name: str, target: Target):
    """The stand-ins, while kernel file ``name``'s host code runs (it imports some of them
    inside its functions, e.g. ``vllm.platforms.rocm``): a context manager."""
    siblings = {IMPORT_NAMES[s]: load(root, s, target) for s in SIBLINGS.get(name, ())}
    return _standing_in({**_stand_ins(target), **siblings})
