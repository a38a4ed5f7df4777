"""Facts read from a compiled kernel's machine code: registers, spills, scratch, shared
memory, store widths, and the instruction mix of its hot loop and of the rest.

AMD: the ``amdgcn`` text Triton keeps (metadata block, ``; ScratchSize:`` comments, and
LLVM's loop comments on every basic block: ``Loop Header: Depth=1`` / ``in Loop:
Header=BB0_9``). NVIDIA: the cubin through ``cuobjdump -res-usage`` (registers, local
memory) and ``nvdisasm`` (SASS; a loop is a label and the backward branch to it).

The hot loop is the loop with the most matrix instructions (else the most
instructions); its counts are per iteration of one wave (warp). The code outside it is
costed along its longest path (an ``if``/``else`` counts one side), so a kernel with
per-kind branches is not charged for both. On AMD, LLVM's structurizer turns an
``if``/``else`` into two guarded regions in a row, joined by "Flow" blocks that branch
on a flag set to a constant just before (``s_mov_b64 s[0:1], 0`` ... ``s_cbranch_scc0``);
such a branch is folded (:class:`_ScalarFolder`), or the path through both regions, which
no wave takes, would be costed.
"""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .targets import Target

_CLASSES = ("matrix", "exp", "trans", "valu", "salu", "vmem", "lds", "scratch")


@dataclass
class Instr:
    op: str
    cls: str  # one of _CLASSES
    cycles: float  # issue cycles of one wave on its SIMD
    matrix_flops: int = 0
    loop: str | None = None  # innermost loop it belongs to
    target: str | None = None  # branch target label
    conditional: bool = False
    ends: bool = False  # program end
    width: int = 0  # bytes per lane of a memory access
    store: bool = False
    load: bool = False
    operands: tuple[str, ...] = ()  # AMD scalar operands, for folding structurizer branches


@dataclass
class Listing:
    instrs: list[Instr] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)  # label -> index of the next instruction

    def add_label(self, name: str) -> None:
        self.labels[name] = len(self.instrs)


# ---- AMD ---------------------------------------------------------------------------------

_AMD_OP = re.compile(r"^(v|s|buffer|global|flat|scratch|ds|image)_[a-z0-9_]+$")
_AMD_MEM = re.compile(r"^(buffer|global|flat|scratch)_(load|store|atomic)_(\w+)$")
_AMD_MATRIX = re.compile(r"^v_(?:mfma|wmma|smfmac)_\w*?(\d+)x(\d+)x(\d+)(?:_(\d+)b)?_?(\w*)")
_AMD_TRANS = ("v_exp_", "v_log_", "v_rcp_", "v_rsq_", "v_sqrt_", "v_sin_", "v_cos_")
_AMD_WIDTH = {"byte": 1, "b8": 1, "short": 2, "b16": 2, "d16": 2, "dword": 4, "b32": 4, "dwordx2": 8, "b64": 8,
              "dwordx3": 12, "b96": 12, "dwordx4": 16, "b128": 16}


def _eight_bit(types: str) -> bool:
    return any(t in types.lower() for t in ("fp8", "bf8", "i8", "e4m3", "e5m2", "u8", "s8"))


def _amd_width(suffix: str) -> int:
    """Bytes per lane of a memory instruction from its suffix (``dwordx4``,
    ``lds_dwordx4``, ``ushort``, ``short_d16_hi``, ``b128``)."""
    for token in suffix.split("_"):
        token = token[1:] if token in ("ubyte", "sbyte", "ushort", "sshort") else token
        if token in _AMD_WIDTH:
            return _AMD_WIDTH[token]
    return 4


def _amd_instr(op: str, operands: str, target: Target) -> Instr:
    matrix = _AMD_MATRIX.match(op)
    if matrix:
        m, n, k = (int(matrix.group(i)) for i in (1, 2, 3))
        flops = 2 * m * n * k * int(matrix.group(4) or 1)
        rate = target.matrix_flops_per_cycle * (2 if _eight_bit(matrix.group(5)) else 1)
        return Instr(op, "matrix", flops / rate, matrix_flops=flops)
    mem = _AMD_MEM.match(op)
    if mem:
        cls = "scratch" if mem.group(1) == "scratch" else "vmem"
        return Instr(op, cls, target.valu_cycles, width=_amd_width(mem.group(3)), store=mem.group(2) == "store",
                     load=mem.group(2) == "load")
    if op.startswith(_AMD_TRANS):
        return Instr(op, "exp" if op.startswith("v_exp_") else "trans", target.trans_cycles)
    if op.startswith("ds_"):
        return Instr(op, "lds", target.valu_cycles)
    if op.startswith("v_"):
        return Instr(op, "valu", target.valu_cycles)
    instr = Instr(op, "salu", 1)
    if op == "s_branch" or op.startswith("s_cbranch"):
        instr.target = operands.split()[0].lstrip(".")
        instr.conditional = op != "s_branch"
    instr.ends = op in ("s_endpgm", "s_setpc_b64")
    return instr


_SREG = re.compile(r"^s(?:(\d+)|\[(\d+):(\d+)\])$")


def _sregs(operand: str) -> frozenset[int] | None:
    """The scalar registers an operand names (``s7``, ``s[0:1]``); None if it names none."""
    m = _SREG.match(operand)
    if not m:
        return None
    lo, hi = (int(m.group(1)),) * 2 if m.group(1) else (int(m.group(2)), int(m.group(3)))
    return frozenset(range(lo, hi + 1))


def _immediate(operand: str) -> int | None:
    try:
        return int(operand, 0)
    except ValueError:
        return None


class _ScalarFolder:
    """Scalar constants and SCC within one basic block, enough to fold the branches of
    LLVM's "Flow" blocks: ``s_mov`` of an immediate, ``s_and`` with ``exec`` (nonzero in
    a block that runs), ``s_cselect``, ``s_cmp_eq/lg_u32``. Anything else that writes a
    scalar register or SCC forgets what it wrote; a label starts afresh."""

    NONZERO = object()  # a value known to be nonzero, not known exactly

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.known: dict[frozenset[int], object] = {}
        self.scc: bool | None = None

    def copy(self) -> "_ScalarFolder":
        other = _ScalarFolder()
        other.known, other.scc = dict(self.known), self.scc
        return other

    def run(self, instrs: list[Instr]) -> bool | None:
        """Step over ``instrs``; whether the last one, a conditional branch, is taken."""
        taken = None
        for instr in instrs:
            taken = self.step(instr.op, instr.operands)
        return taken

    def _value(self, operand: str):
        imm = _immediate(operand)
        if imm is not None:
            return imm
        if operand == "exec":
            return self.NONZERO
        return self.known.get(_sregs(operand))

    def _write(self, dest: str, value) -> None:
        regs = _sregs(dest)
        if regs is None:
            return
        self.known = {r: v for r, v in self.known.items() if not r & regs}
        if value is not None:
            self.known[regs] = value

    def step(self, op: str, operands: list[str]) -> bool | None:
        """Advance over one instruction; for a conditional SCC branch, whether it is taken
        (None: not known here)."""
        if op in ("s_cbranch_scc0", "s_cbranch_scc1"):
            return None if self.scc is None else self.scc == (op == "s_cbranch_scc1")
        if op.startswith(("s_waitcnt", "s_nop", "s_branch", "s_cbranch", "s_barrier", "s_endpgm")):
            return None
        value, scc = None, None
        if op.startswith("s_mov_b") and len(operands) == 2:
            value = self._value(operands[1])
            scc = self.scc  # s_mov leaves SCC alone
        elif op.startswith("s_and_b") and len(operands) == 3:
            a, b = self._value(operands[1]), self._value(operands[2])
            if 0 in (a, b):
                value, scc = 0, False
            elif a is not None and b is not None and self.NONZERO in (a, b) and {a, b} <= {self.NONZERO, -1}:
                value, scc = self.NONZERO, True
        elif op.startswith("s_cselect_b") and len(operands) == 3 and self.scc is not None:
            value = self._value(operands[1] if self.scc else operands[2])
            scc = self.scc
        elif op in ("s_cmp_eq_u32", "s_cmp_lg_u32") and len(operands) == 2:
            a, b = self._value(operands[0]), self._value(operands[1])
            if isinstance(a, int) and isinstance(b, int):
                scc = (a == b) == (op == "s_cmp_eq_u32")
            self.scc = scc
            return None
        if operands:
            self._write(operands[0], value)
        if op.startswith("s_"):
            self.scc = scc
        return None


def amd_listing(asm: str, target: Target) -> Listing:
    listing = Listing()
    current = None
    for line in asm.splitlines():
        stripped = line.strip()
        label = re.match(r"^\.?(LBB\d+_\d+|; %bb\.\d+):", stripped)
        if label:
            listing.add_label(label.group(1))
            current = None
        header = re.search(r"Loop Header: Depth=\d+", line)
        inside = re.search(r"in Loop: Header=(BB\d+_\d+)", line)
        if header:
            name = re.match(r"^\.L(BB\d+_\d+):", stripped)
            current = name.group(1) if name else (current or f"loop{len(listing.instrs)}")
        elif inside:
            current = inside.group(1)
        if label or not stripped or stripped.startswith((";", ".")):
            continue
        parts = stripped.split(None, 1)
        if not _AMD_OP.match(parts[0]):
            continue
        operands = parts[1].split(";")[0] if len(parts) > 1 else ""
        instr = _amd_instr(parts[0], operands, target)
        if parts[0].startswith("s_"):
            instr.operands = tuple(o.strip() for o in operands.split(",") if o.strip())
        instr.loop = current
        listing.instrs.append(instr)
    return listing


def amd_facts(asm: str, target: Target) -> dict:
    meta = {}
    for key in ("vgpr_count", "agpr_count", "sgpr_count", "vgpr_spill_count", "sgpr_spill_count"):
        m = re.search(rf"^\s+\.{key}:\s+(\d+)", asm, re.M)
        meta[key] = int(m.group(1)) if m else 0
    scratch = re.search(r"; ScratchSize: (\d+)", asm)
    occupancy = re.search(r"; Occupancy: (\d+)", asm)
    allocated = re.search(r"; NumVGPRsForWavesPerEU: (\d+)", asm)
    facts = {"vgpr": meta["vgpr_count"], "agpr": meta["agpr_count"], "sgpr": meta["sgpr_count"],
             "vgpr_spills": meta["vgpr_spill_count"], "sgpr_spills": meta["sgpr_spill_count"],
             "scratch_bytes": int(scratch.group(1)) if scratch else 0,
             "occupancy_waves": int(occupancy.group(1)) if occupancy else None,
             "vgpr_allocated": int(allocated.group(1)) if allocated else None}
    return facts | listing_facts(amd_listing(asm, target))


# ---- NVIDIA ------------------------------------------------------------------------------

_SASS_LINE = re.compile(r"/\*[0-9a-f]+\*/\s+(@!?U?P[0-7T]\s+)?([A-Z][A-Za-z0-9_.]*)")
_SASS_MATRIX = re.compile(r"^(HGMMA|HMMA|IMMA|QGMMA)\.")
_SASS_MMA_SHAPES = {"16816": (16, 8, 16), "1688": (16, 8, 8), "16832": (16, 8, 32), "884": (8, 8, 4)}


def _sass_width(op: str) -> int:
    for suffix, width in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1), (".S8", 1)):
        if suffix in op:
            return width
    return 4


def _sass_instr(op: str, predicated: bool, line: str, target: Target) -> Instr:
    if _SASS_MATRIX.match(op):
        parts = op.split(".")
        if parts[0] in ("HGMMA", "QGMMA"):  # warpgroup-wide MxNxK: each of its 4 warps issues a quarter
            m, n, k = (int(x) for x in parts[1].split("x"))
            flops = 2 * m * n * k // 4
        else:
            m, n, k = _SASS_MMA_SHAPES.get(parts[1], (16, 8, 16))
            flops = 2 * m * n * k
        rate = target.matrix_flops_per_cycle * (2 if _eight_bit(op) else 1)
        return Instr(op, "matrix", flops / rate, matrix_flops=flops)
    if op.startswith("MUFU"):
        return Instr(op, "exp" if ".EX2" in op else "trans", target.trans_cycles)
    if op.startswith(("LDL", "STL")):
        return Instr(op, "scratch", 1, width=_sass_width(op), store=op.startswith("STL"))
    if op.startswith(("LDG", "STG", "LDGSTS", "RED", "ATOM", "ST.", "LD.")):
        return Instr(op, "vmem", 1, width=_sass_width(op), store=op.startswith(("STG", "ST.")),
                     load=op.startswith(("LDG", "LD.")))
    if op.startswith(("LDS", "STS", "LDSM")):
        return Instr(op, "lds", 1)
    instr = Instr(op, "salu" if op.startswith("U") else "valu", 1)
    if op.startswith("BRA") and "`(" in line:
        instr.target = line.split("`(")[1].split(")")[0]
        instr.conditional = predicated
    instr.ends = op.startswith(("EXIT", "RET")) and not predicated
    return instr


def sass_listing(sass: str, target: Target) -> Listing:
    listing = Listing()
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            listing.add_label(label.group(1))
            continue
        m = _SASS_LINE.search(line)
        if m:
            listing.instrs.append(_sass_instr(m.group(2), bool(m.group(1)), line, target))
    # Loops: a backward branch to a label; the innermost (shortest) loop claims its body.
    spans = sorted(((listing.labels[i.target], n) for n, i in enumerate(listing.instrs)
                    if i.target in listing.labels and listing.labels[i.target] < n), key=lambda s: s[0] - s[1])
    for start, end in spans:
        for instr in listing.instrs[start:end + 1]:
            instr.loop = instr.loop or f"loop{start}"
    return listing


def nvidia_facts(cubin: bytes, target: Target) -> dict:
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", str(path)], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", str(path)], capture_output=True, text=True,
                              check=True).stdout
    res = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    listing = sass_listing(sass, target)
    facts = {"registers": res.get("REG", 0), "vgpr": res.get("REG", 0), "agpr": 0, "sgpr": 0,
             "vgpr_spills": sum(1 for i in listing.instrs if i.op.startswith("STL")), "sgpr_spills": 0,
             "scratch_bytes": res.get("LOCAL", 0) + res.get("STACK", 0), "occupancy_waves": None,
             "vgpr_allocated": None}
    return facts | listing_facts(listing)


# ---- shared ------------------------------------------------------------------------------

def _counts(instrs: list[Instr]) -> dict:
    counts = collections.Counter(i.cls for i in instrs)
    matrix = collections.Counter(i.op for i in instrs if i.cls == "matrix")
    loads = collections.Counter(i.width for i in instrs if i.load)
    return {"instructions": len(instrs), "matrix": counts["matrix"], "matrix_kinds": dict(matrix),
            "matrix_flops": sum(i.matrix_flops for i in instrs),
            "matrix_cycles": sum(i.cycles for i in instrs if i.cls == "matrix"),
            "vector_cycles": sum(i.cycles for i in instrs if i.cls != "matrix"),
            **{c: counts[c] for c in _CLASSES if c != "matrix"},
            "load_widths": {str(w): n for w, n in sorted(loads.items())}}


def _longest_path_cycles(listing: Listing, skip_loop: str | None, avoid_matrix: bool = False) -> float | None:
    """Cycles along the costliest path from the entry to a program end through the code
    outside ``skip_loop``; an edge to an earlier block is a loop's back edge and is not
    followed (the graph is acyclic). A block whose branch the scalar constants of the
    block before it decide (a "Flow" block) is passed through along that edge to the one
    successor it takes. ``avoid_matrix``: only paths through blocks without matrix
    instructions outside ``skip_loop`` (None if there is none): the path of a program that
    skips a peeled last trip of the loop."""
    instrs = listing.instrs
    if not instrs:
        return 0.0
    starts = sorted({0, *listing.labels.values(), *(n + 1 for n, i in enumerate(instrs) if i.target or i.ends)})
    starts = [s for s in starts if s < len(instrs)]
    bounds = list(zip(starts, starts[1:] + [len(instrs)]))
    block_of = {s: b for b, s in enumerate(starts)}

    def cost(b: int) -> float:
        start, end = bounds[b]
        outside = [i for i in instrs[start:end] if skip_loop is None or i.loop != skip_loop]
        if avoid_matrix and any(i.cls == "matrix" for i in outside):
            return float("-inf")
        return sum(i.cycles for i in outside)

    def ends(b: int) -> bool:
        last = instrs[bounds[b][1] - 1]
        return last.ends or b == len(bounds) - 1

    def successors(b: int, taken: bool | None = None) -> list[int]:
        last = instrs[bounds[b][1] - 1]
        out = [] if taken is False else [block_of.get(listing.labels.get(last.target, -1))]
        if not last.ends and (last.target is None or (last.conditional and taken is not True)):
            out.append(b + 1)
        return [t for t in out if t is not None and b < t < len(bounds)]

    reach = [float("-inf")] * len(bounds)  # costliest way into each block
    reach[0] = 0.0
    longest = float("-inf")
    for b in range(len(bounds)):
        out = reach[b] + cost(b)
        if out == float("-inf"):
            continue
        if ends(b):
            longest = max(longest, out)
        state = _ScalarFolder()
        state.run(instrs[slice(*bounds[b])])
        for t in successors(b):
            taken = None
            if instrs[bounds[t][1] - 1].conditional:
                taken = state.copy().run(instrs[slice(*bounds[t])])
            if taken is None:
                reach[t] = max(reach[t], out)
                continue
            through = out + cost(t)
            if through == float("-inf"):
                continue
            if ends(t):
                longest = max(longest, through)
            for u in successors(t, taken):
                reach[u] = max(reach[u], through)
    return None if longest == float("-inf") else longest


def listing_facts(listing: Listing) -> dict:
    loops = collections.defaultdict(list)
    for instr in listing.instrs:
        if instr.loop:
            loops[instr.loop].append(instr)
    hot_name = max(loops, key=lambda n: (sum(i.cls == "matrix" for i in loops[n]), len(loops[n])), default=None)
    stores = collections.Counter(i.width for i in listing.instrs if i.store and i.cls != "scratch")
    return {"instructions": len(listing.instrs),
            "store_widths": {str(w): n for w, n in sorted(stores.items())},
            "hot_loop": _counts(loops[hot_name]) if hot_name else None,
            "straight_cycles": _longest_path_cycles(listing, hot_name),
            "unpeeled_straight_cycles": _longest_path_cycles(listing, hot_name, avoid_matrix=True)}


def compiled_facts(compiled, target: Target) -> dict:
    """Every fact the audit reads from one compiled kernel (plain JSON types)."""
    if target.amd:
        facts = amd_facts(compiled.asm["amdgcn"], target)
    else:
        facts = nvidia_facts(compiled.asm["cubin"], target)
    facts["shared_bytes"] = int(compiled.metadata.shared)
    facts["num_warps"] = int(compiled.metadata.num_warps)
    return facts
