"""The backends' names, one folder each under the top-level ``backends/``.

Its own module at the bottom of the package so the settings (:mod:`dflash_rocm.envs`) can
judge ``DFLASH_ROCM_BACKEND`` without importing the registry, which sits above the
planning layer that reads the settings.
"""

NAMES: tuple[str, ...] = ("reference", "triton", "rocm", "aiter", "cuda", "cpu")
