"""Every environment variable dflash_rocm reads, in one table.

Values are read at the moment they are needed (never cached at import), so tests and
long-lived servers see changes; ``dflash-rocm info`` prints this table with the
values in effect.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str

    def get(self) -> str:
        value = os.environ.get(self.name)
        return self.default if value is None or value.strip() == "" else value.strip()

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name, "").strip())


BACKEND = EnvVar(
    "DFLASH_ROCM_BACKEND", "auto",
    "backend for both operations: auto, reference, triton, rocm, cuda or cpu "
    "(the backend= argument of a call wins)")
LOG_LEVEL = EnvVar(
    "DFLASH_ROCM_LOG_LEVEL", "WARNING",
    "level of the 'dflash_rocm' logger (INFO shows which backend served each new call shape)")
QUERY_LIMIT = EnvVar(
    "DFLASH_ROCM_QUERY_LIMIT", "",
    "rocm: largest query length per request the segmented kernel is compiled and tuned for "
    "(DFlash: num_speculative_tokens + 1); longer queries take the unsegmented path")
TUNE = EnvVar(
    "DFLASH_ROCM_TUNE", "auto",
    "rocm startup tuning: 0, 1 or auto (auto: on for RDNA gfx1x)")
CACHE_DIR = EnvVar(
    "DFLASH_ROCM_CACHE_DIR", "",
    "where tuned launch configs are kept (default: $XDG_CACHE_HOME/dflash_rocm)")
AITER = EnvVar(
    "DFLASH_ROCM_AITER", "auto",
    "rocm: 0 never uses aiter; auto uses its paged attention on CDNA where it serves the call "
    "(checked against the Triton kernel on first use)")
VLLM = EnvVar(
    "DFLASH_ROCM_VLLM", "1",
    "0 leaves vLLM untouched even when the plugin is installed")
TRITON_INTERPRET = EnvVar(
    "TRITON_INTERPRET", "0",
    "1 runs Triton kernels on CPU tensors through the interpreter (read when kernels are "
    "first imported)")

ALL: tuple[EnvVar, ...] = (BACKEND, LOG_LEVEL, QUERY_LIMIT, TUNE, CACHE_DIR, AITER, VLLM, TRITON_INTERPRET)
