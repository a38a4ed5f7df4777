"""A bound-and-bottleneck time model of one launch, from compiled facts and traffic.

Per launch: ``time = launch gap + max(issue, DRAM, L2, Infinity Cache)``, summed over the
launch's phases when it has several (programs that wait on the others' work, such as the
attention's merger programs, run in a later phase), where

- *issue* is the makespan of the programs dealt round-robin, in dispatch order, to the
  units, each running up to its resident workgroups at once (from registers, waves and
  shared memory) and sharing its SIMDs among them (processor sharing: when a program
  ends, the others speed up). A program takes its hot-loop trips times the cycles one
  iteration needs on a SIMD shared by ``k`` co-resident waves,
  ``max(k*matrix, k*vector, matrix + vector)`` (matrix and vector work of different waves
  overlap; one wave's own do not), or the
  load latency over ``num_stages`` when that is longer (a merge's trips wait on data
  other programs wrote: the remote latency), plus its straight-line code
  (longest path; for a program without the peeled, masked last trip, the longest path
  that runs no matrix code outside the loop; for one that merges no split work, that of
  the kernel compiled without the merge or the split) and the latency of
  its dependent loads (index tables; partials other programs wrote, for a merge);
- *DRAM* is the bytes that miss every cache at the peak bandwidth, derated when the
  resident programs cannot keep ``bandwidth x latency`` bytes in flight (Little's law);
- *L2* and *Infinity Cache* are the bytes each level serves at its bandwidth. A chunk
  read again hits a cache if that cache saw it recently (within two rounds of programs)
  or the launch's whole working set fits in half of it; on MI300/MI355 consecutive
  programs go to different XCDs, each with its own L2.

Every constant is in :mod:`.targets` and printed with the results. This is a model of
the compiled code, not a measurement.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .targets import Target
from .traffic import Program


@dataclass(frozen=True)
class Occupancy:
    waves_per_simd: float  # resident waves per SIMD when the unit is full
    groups_per_unit: int  # resident workgroups (programs) per CU / SM
    limited_by: str

    def slots(self, target: Target) -> int:
        return self.groups_per_unit * target.units


def occupancy(facts: dict, target: Target) -> Occupancy:
    warps = facts["num_warps"]
    shared = facts["shared_bytes"]
    limits = {}
    if target.amd:
        waves = facts.get("occupancy_waves") or target.max_waves_per_simd
        limits["registers"] = max(1, (waves * target.simds) // warps) if waves else 0
    else:
        regs_per_warp = math.ceil(max(facts["registers"], 1) * 32 / 256) * 256
        warps_per_sm = min(64, (16384 // regs_per_warp) * 4)
        limits["registers"] = warps_per_sm // warps
        limits["blocks"] = 32
    limits["waves"] = (target.max_waves_per_simd * target.simds) // warps
    if shared:
        limits["shared memory"] = target.lds_bytes // (shared + (0 if target.amd else 1024))
    limited_by = min(limits, key=limits.get)
    groups = limits[limited_by]
    return Occupancy(groups * warps / target.simds, groups, limited_by)


@dataclass(frozen=True)
class LaunchModel:
    programs: int
    active_programs: int
    slots: int
    occupancy: Occupancy
    iteration_cycles: float  # one hot-loop trip of one wave at the launch's co-residency
    unroll: int  # trips per compiled iteration of the hot loop (the compiler unrolled it)
    requested_bytes: int  # every byte programs read or write (through L2)
    llc_bytes: int  # bytes crossing the L2s (served by the Infinity Cache or DRAM)
    dram_bytes: int
    write_bytes: int
    reread_bytes: int  # requested reads beyond the first of each chunk
    issue_s: float
    dram_s: float
    l2_s: float
    llc_s: float
    fill: float  # fraction of DRAM bandwidth the resident programs can keep busy
    seconds: float

    @property
    def bound(self) -> str:
        terms = {"issue": self.issue_s, "DRAM": self.dram_s, "L2": self.l2_s, "IC": self.llc_s}
        return max(terms, key=terms.get)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["occupancy"] = asdict(self.occupancy)
        out["bound"] = self.bound
        return out


def _cache_misses(programs: list[Program], domains: int, capacity: int, window: int) -> int:
    """Bytes of chunk reads that miss a cache level (one cache per domain; program ``i``
    runs in domain ``i % domains``)."""
    per_domain: list[dict] = [{} for _ in range(domains)]
    per_domain_total = [0] * domains
    for i, p in enumerate(programs):
        seen = per_domain[i % domains]
        for chunk, size in p.reads:
            if chunk not in seen:
                per_domain_total[i % domains] += size
                seen[chunk] = None
    fits = [total <= capacity // 2 for total in per_domain_total]
    last: list[dict] = [{} for _ in range(domains)]
    missed = 0
    for i, p in enumerate(programs):
        d = i % domains
        for chunk, size in p.reads:
            when = last[d].get(chunk)
            if when is None or not (fits[d] or (i - when) // domains <= window):
                missed += size
            last[d][chunk] = i
    return missed


def _iteration(loop: dict | None, k: float) -> float:
    """Cycles of one hot-loop iteration of each of ``k`` waves sharing a SIMD: matrix and
    vector work of different waves overlap, one wave's own do not."""
    if not loop:
        return 0.0
    matrix, vector = loop["matrix_cycles"], loop["vector_cycles"]
    return max(k * matrix, k * vector, matrix + vector)


def _straight_cycles(facts: dict, p: Program) -> float:
    """Cycles of the straight-line code ``p`` runs: its role's variant's (see
    :func:`.traffic.role_variants`), along the longest path that skips a peeled last trip
    when ``p`` has none; each falls back to the launch's longest path where there is no
    such variant or path."""
    roles = [f"{p.role}_", ""] if p.role else [""]
    peels = ["unpeeled_", ""] if p.skips_peeled_trip else [""]
    keys = [role + peel + "straight_cycles" for role in roles for peel in peels]
    return next(facts[key] for key in keys if facts.get(key) is not None)


def _hot_loop(facts: dict, p: Program) -> dict | None:
    """The hot loop ``p`` runs: its role's variant's (see :func:`.traffic.role_variants`),
    else the launch's."""
    key = f"{p.role}_hot_loop"
    return facts[key] if p.role and key in facts else facts.get("hot_loop")


def unroll(loop: dict | None, warps: int, trip_flops: int) -> int:
    """Source-level trips one compiled iteration of ``loop`` runs: LLVM unrolls a loop whose
    trips are all alike, and the loop's matrix work then counts whole trips
    (``trip_flops``: the matrix FLOPs of one trip of the program). 1 when the loop has no
    matrix work, or not a whole multiple of a trip (a layout that repeats part of its
    work is not an unroll)."""
    if not loop or not trip_flops or not loop.get("matrix_flops"):
        return 1
    ratio = loop["matrix_flops"] * warps / trip_flops
    whole = round(ratio)
    return whole if whole >= 2 and abs(ratio - whole) < 1e-6 else 1


def _makespan(programs: list[Program], units: int, groups_per_unit: int, busy) -> float:
    """When the last program ends. Programs go to units round-robin in dispatch order
    (as the dispatcher deals them when all fit at once, and in steady state when they do
    not); a unit runs up to ``groups_per_unit`` of its programs at once, sharing its SIMDs:
    each progresses at ``1 / busy(p, resident)`` of its work per second, so when one ends the
    others speed up, and the next in the unit's queue starts."""
    end = 0.0
    for unit in range(min(units, len(programs))):
        queue = programs[unit::units]
        running: list[list] = []  # [program, work left (fraction)]
        now, nxt = 0.0, 0
        while running or nxt < len(queue):
            while len(running) < groups_per_unit and nxt < len(queue):
                running.append([queue[nxt], 1.0])
                nxt += 1
            resident = max(1, sum(p.active for p, _ in running))  # a program that exits at once shares nothing
            rates = [1.0 / max(busy(p, resident), 1e-15) for p, _ in running]
            step = min(left / rate for (_, left), rate in zip(running, rates))
            now += step
            for entry, rate in zip(running, rates):
                entry[1] -= rate * step
            running = [entry for entry in running if entry[1] > 1e-9]
        end = max(end, now)
    return end


@dataclass(frozen=True)
class _Phase:
    """One phase's bound terms and traffic (see :func:`model_launch`)."""

    issue_s: float
    dram_s: float
    l2_s: float
    llc_s: float
    fill: float
    requested: int
    llc: int
    dram: int
    writes: int
    reread: int

    @property
    def seconds(self) -> float:
        return max(self.issue_s, self.dram_s, self.l2_s, self.llc_s)


def _model_phase(programs: list[Program], facts: dict, target: Target, num_stages: int, occ: Occupancy,
                 trip_flops: int) -> _Phase:
    slots = occ.slots(target)
    warps = facts["num_warps"]
    active = [p for p in programs if p.active]
    loop = facts.get("hot_loop")
    # Traffic through the hierarchy.
    reads = sum(size for p in programs for _, size in p.reads)
    writes = sum(p.write_bytes for p in programs)
    scratch = 0
    if loop and loop["scratch"]:
        scratch = sum(p.iterations for p in active) * warps * loop["scratch"] * target.wave_size * 8
    window = 2 * max(1, slots // target.l2_domains)
    l2_miss = _cache_misses(programs, target.l2_domains, target.l2_bytes, window)
    unique = sum({chunk: size for p in programs for chunk, size in p.reads}.values())
    if target.llc_bytes:
        dram_reads = _cache_misses(programs, 1, target.llc_bytes, 2 * slots)
        llc = l2_miss + writes
    else:
        dram_reads, llc = l2_miss, 0
    # A trip waits for its loads unless they were issued num_stages - 1 trips ahead; a load
    # takes the DRAM latency for the share of bytes that miss the caches, the L2's otherwise.
    miss = dram_reads / reads if reads else 1.0
    latency = miss * target.dram_latency_s + (1 - miss) * target.l2_latency_s
    # Data other programs wrote is in this program's L2 only when there is one L2.
    remote_s = target.l2_latency_s if target.l2_domains == 1 else target.dram_latency_s
    # Issue makespan: each unit runs its programs sharing its SIMDs (see _makespan).

    def busy(p: Program, resident: int) -> float:
        """Seconds ``p`` takes while ``resident`` programs share its unit."""
        seconds = p.chain * target.l2_latency_s
        if not p.active:
            return seconds
        k = max(1.0, resident * warps / target.simds)
        waits = remote_s if p.remote_trips else latency
        hot = _hot_loop(facts, p)
        trip = max(_iteration(hot, k) / unroll(hot, warps, trip_flops) / target.clock_hz, waits / max(1, num_stages))
        straight = k * _straight_cycles(facts, p)
        # The first streaming load's latency (a merge's is its first trip's remote wait).
        streams = p.iterations or (p.reads and not p.remote_chain)
        first = target.dram_latency_s if streams and not p.remote_trips else 0.0
        return seconds + (p.iterations * trip + straight / target.clock_hz + p.remote_chain * remote_s + first)

    issue = _makespan(programs, target.units, occ.groups_per_unit, busy)
    dram = dram_reads + writes
    requested = reads + writes + scratch
    per_iteration = [sum(s for _, s in p.reads) / max(1, p.iterations) for p in active[:slots]]
    in_flight = sum(per_iteration) * max(1, num_stages)
    fill = min(1.0, in_flight / (target.peak.bandwidth * target.dram_latency_s)) if in_flight else 1.0
    return _Phase(issue, dram / (target.peak.bandwidth * fill) if dram else 0.0, requested / target.l2_bandwidth,
                  llc / target.llc_bandwidth if llc else 0.0, fill, requested, llc, dram, writes, reads - unique)


def model_launch(programs: list[Program], facts: dict, target: Target, num_stages: int,
                 trip_flops: int = 0) -> LaunchModel:
    """The launch's model; ``trip_flops``: the matrix FLOPs one hot-loop trip of a program
    does (0: unknown), so that a loop the compiler unrolled is costed per trip."""
    occ = occupancy(facts, target)
    slots = occ.slots(target)
    if slots == 0:
        raise ValueError(f"a workgroup of this kernel does not fit on {target.arch} ({occ.limited_by})")
    active = [p for p in programs if p.active]
    resident_per_unit = min(occ.groups_per_unit, max(1, math.ceil(len(active) / target.units)))
    loop = facts.get("hot_loop")
    per = unroll(loop, facts["num_warps"], trip_flops)
    iteration = _iteration(loop, max(1.0, resident_per_unit * facts["num_warps"] / target.simds)) / per
    # Phases run one after the other: a later phase's programs wait on the earlier ones' work.
    phases = [_model_phase([p for p in programs if p.phase == n], facts, target, num_stages, occ, trip_flops)
              for n in sorted({p.phase for p in programs})]

    def total(name: str):
        return sum(getattr(ph, name) for ph in phases)

    seconds = target.launch_gap_s + sum(ph.seconds for ph in phases)
    return LaunchModel(len(programs), len(active), slots, occ, iteration, per, total("requested"), total("llc"),
                       total("dram"), total("writes"), total("reread"), total("issue_s"), total("dram_s"),
                       total("l2_s"), total("llc_s"), min(ph.fill for ph in phases), seconds)
