"""The GPU targets the audit compiles for, and the machine model of each one.

Every number here is an assumption of the model, printed beside every modelled figure:
bandwidths and dense bf16 peaks, wave size, compute units and the fp8 format come from the
architecture's record (:mod:`dflash_rocm.arch`, vendor figures); clocks are the vendors' peak engine
clocks; per-cycle matrix rates
are derived from those peaks (peak / (units x SIMDs x clock)), so a kernel that kept
every matrix unit busy would reach the vendor figure exactly. Cache sizes, cache
bandwidths, latencies and launch gaps are public figures or estimates, marked as such.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_rocm.arch import Product, arch_info

KiB, MiB = 1024, 1024 * 1024


@dataclass(frozen=True)
class Target:
    arch: str  # compile target: "gfx942", "sm_90", ...
    peak: Product  # the part modelled (bandwidth, dense bf16 FLOP/s)
    backend: str  # Triton backend: "hip" | "cuda"
    wave_size: int
    units: int  # CUs (AMD) or SMs (NVIDIA)
    simds: int  # per unit: SIMDs (AMD) or SM sub-partitions (NVIDIA); each issues one wave at a time
    clock_hz: float
    max_waves_per_simd: int
    lds_bytes: int  # per unit, usable by the workgroups resident on it
    l2_bytes: int  # per L2 domain
    l2_domains: int  # separate L2s a launch's programs are spread over (MI300/MI355: 8 XCDs)
    l2_bandwidth: float  # bytes/s, all domains together
    llc_bytes: int  # memory-side last-level cache (AMD Infinity Cache); 0: none
    llc_bandwidth: float
    dram_latency_s: float  # loaded latency of a DRAM access
    l2_latency_s: float
    launch_gap_s: float  # a dependent launch's start after the previous one ends (eager stream)
    valu_cycles: int  # cycles one SIMD needs per full-wave vector ALU instruction
    trans_cycles: int  # per transcendental (exp2, rsqrt, rcp) instruction
    fp8_dtype: torch.dtype | None  # the fp8 cache format converted in hardware (None: no fp8)

    @property
    def amd(self) -> bool:
        return self.backend == "hip"

    @property
    def matrix_flops_per_cycle(self) -> float:
        """Dense bf16 FLOP one SIMD (sub-partition) retires per cycle at the vendor peak."""
        return self.peak.bf16_flops / (self.units * self.simds * self.clock_hz)

    def triton_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(*arch_info(self.arch).compile_target)

    def assumptions(self) -> str:
        p = self.peak
        llc = (f", Infinity Cache {self.llc_bytes // MiB} MiB at {self.llc_bandwidth / 1e12:.1f} TB/s"
               if self.llc_bytes else "")
        return (f"{self.arch} as {p.name}: HBM {p.bandwidth / 1e12:.2f} TB/s, {p.bf16_flops / 1e12:.0f} bf16 "
                f"TFLOP/s ({self.matrix_flops_per_cycle:.0f} FLOP/cycle/SIMD), {self.units} "
                f"{'CUs' if self.amd else 'SMs'} x {self.simds} SIMDs at {self.clock_hz / 1e9:.2f} GHz, "
                f"L2 {self.l2_domains} x {self.l2_bytes // MiB} MiB at {self.l2_bandwidth / 1e12:.1f} TB/s{llc}; "
                f"DRAM at the vendor peak (sustained is lower: not modelled); "
                f"latency DRAM {self.dram_latency_s * 1e9:.0f} ns, L2 {self.l2_latency_s * 1e9:.0f} ns; "
                f"launch gap {self.launch_gap_s * 1e6:.1f} us; VALU {self.valu_cycles} / transcendental "
                f"{self.trans_cycles} cycles per wave instruction")


def _target(arch: str, product: str, *model) -> Target:
    """A target from its architecture's record (Triton backend, wave, CUs, fp8 format and
    the product's peaks) and the model-only figures that follow ``simds`` in :class:`Target`."""
    info = arch_info(arch)
    peak = next(p for p in info.products if p.name == product)
    simds, clock, waves, lds, l2, domains, l2_bw, llc, llc_bw, dram_lat, l2_lat, gap, valu, trans = model
    return Target(arch, peak, info.compile_target[0], info.wave_size, info.compute_units, simds, clock, waves, lds,
                  l2, domains, l2_bw, llc, llc_bw, dram_lat, l2_lat, gap, valu, trans, info.fp8_dtype)


# Clocks: vendor peak engine clocks. L2/LLC bandwidths: CDNA3 whitepaper (128 B/clk per L2
# channel, 16 channels per XCD; Infinity Cache 17.2 TB/s), the others estimates. Latencies:
# published pointer-chase figures, rounded up for load. Launch gap: eager stream, estimate.
TARGETS: dict[str, Target] = {t.arch: t for t in (
    _target("gfx942", "MI300X", 4, 2.1e9, 8, 64 * KiB, 4 * MiB, 8, 34.4e12, 256 * MiB, 17.2e12, 0.9e-6, 0.3e-6,
            2.0e-6, 4, 16),
    _target("gfx950", "MI355X", 4, 2.4e9, 8, 160 * KiB, 4 * MiB, 8, 39.3e12, 256 * MiB, 17.2e12, 0.9e-6, 0.3e-6,
            2.0e-6, 4, 16),
    _target("gfx1100", "RX 7900 XTX", 2, 2.5e9, 16, 64 * KiB, 6 * MiB, 1, 5.0e12, 96 * MiB, 3.5e12, 0.6e-6,
            0.25e-6, 2.0e-6, 1, 4),
    _target("gfx1201", "Radeon AI PRO R9700", 2, 2.92e9, 16, 64 * KiB, 8 * MiB, 1, 4.0e12, 64 * MiB, 2.5e12,
            0.6e-6, 0.25e-6, 2.0e-6, 1, 4),
    _target("sm_90", "H200", 4, 1.83e9, 16, 228 * KiB, 50 * MiB, 1, 5.5e12, 0, 0.0, 0.7e-6, 0.25e-6, 1.0e-6, 1, 8),
)}


def modelled_backend(vendor: str) -> str:
    """The backend the audit models on a GPU of ``vendor`` (a platform's vendor): ``rocm``
    on AMD (its launch tables), ``triton`` elsewhere."""
    return "rocm" if vendor == "rocm" else "triton"
