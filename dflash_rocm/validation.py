"""The argument checks both operations share; each op's ``validation`` module builds on them.

Every check runs before anything is written, and none waits for the device:

- Structural checks (types, dtypes, shapes, devices, overlap between the tensors a call
  writes and the ones it reads) look only at tensor metadata on the host.
- Index checks (block ids, slots, positions, ``q_len <= seq_len``, scale values) read
  tensor *values*. For CPU tensors they run on the host and raise a ``ValueError`` naming
  the first offender. For GPU tensors they are queued on the device as asynchronous
  asserts (``torch._assert_async``): no host sync, graph-capturable, and a bad index
  still fails loudly (a device-side assert) before the kernel that would use it runs.
  ``validate=False`` skips these; the structural checks always run.

Index tensors are read by the kernels with unit strides, so a non-contiguous one is
copied to a contiguous tensor here (a few bytes, only when needed); every other tensor's
strides are passed to the kernels and honoured as they are.

Every message names the argument, what was expected and what was received.
"""

from __future__ import annotations

import bisect
import numbers
import operator
from typing import Any, Callable, Sequence

import torch

from .contract import INDEX_DTYPES
from .paged import PackedCache, memory_of

INT32_MAX = 2**31 - 1


def tensor_arg(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.device.type == "meta":
        raise ValueError(f"{name}: tensors on the meta device hold no data; expected a tensor on a CPU or GPU")
    return value


def cache_arg(name: str, value: Any) -> torch.Tensor | PackedCache:
    """A paged cache: a strided tensor or a :class:`PackedCache` (shape checks follow)."""
    if isinstance(value, PackedCache):
        tensor_arg(name, value.view)
        return value
    return tensor_arg(name, value)


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name}: expected dtype {names}; got {str(t.dtype).replace('torch.', '')}")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None], words: str) -> None:
    if len(t.shape) != len(expected) or any(e is not None and s != e for s, e in zip(t.shape, expected)):
        shown = [("?" if e is None else e) for e in expected]
        raise ValueError(f"{name}: expected shape {words} = {shown}; got {list(t.shape)}")


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where query/context_states are); got {t.device}")


def index_tensor(name: str, value: Any, shape: Sequence[int | None], words: str,
                 device: torch.device) -> torch.Tensor:
    """An int32/int64 index tensor of ``shape`` on ``device``, contiguous (copied if it was a
    strided view: the kernels index these with unit strides)."""
    t = tensor_arg(name, value)
    check_dtype(name, t, INDEX_DTYPES)
    check_shape(name, t, shape, words)
    check_device(name, t, device)
    return t if t.is_contiguous() else t.contiguous()


def int_bound(name: str, value: Any, *, low: int, high: int = INT32_MAX) -> int:
    """An int in ``[low, high]`` (the kernels take 32-bit sizes), never a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name}: expected an int in [{low}, {high}]; got {value}")
    return int(value)


_FLOAT32 = torch.finfo(torch.float32)


def positive_float(name: str, value: Any) -> float:
    """A scale as a Python float: positive, and a normal float32 (kernels take scales in
    float32, where a smaller value flushes to 0 and a larger one is inf)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    if not _FLOAT32.tiny <= value <= _FLOAT32.max:
        raise ValueError(f"{name}: expected a positive finite scale (a normal float32, "
                         f"[{_FLOAT32.tiny:.3g}, {_FLOAT32.max:.3g}]), got {value}")
    return float(value)


# -- overlap -------------------------------------------------------------------------------

def _dims(t: torch.Tensor) -> list[tuple[int, int]]:
    """(size, stride) of every dimension that has more than one element."""
    return [(s, st) for s, st in zip(t.shape, t.stride()) if s > 1]


def _nested(dims: list[tuple[int, int]], inner_span: int = 1) -> bool:
    """True when no two index tuples of these dims reach the same element: sorted by
    stride, each stride steps past everything the smaller dims (and ``inner_span``
    elements below them) reach."""
    reach = inner_span
    for size, stride in sorted(dims, key=lambda d: d[1]):
        if stride < reach:
            return False
        reach = stride * (size - 1) + reach
    return True


def internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an expanded or aliased view). A layout
    this cannot prove free of aliasing counts as overlapping: it is only asked of tensors
    a call writes."""
    if t.numel() <= 1:
        return False
    dims = _dims(t)
    return any(st <= 0 for _, st in dims) or not _nested(dims)


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes from ``t``'s first element to the end of its last: ``[first, end)`` (not
    empty, strides >= 0)."""
    first = t.data_ptr()
    return first, first + (sum((s - 1) * st for s, st in _dims(t)) + 1) * t.element_size()


def provably_disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` touch no common element, judged by memory addresses (two
    storages may share memory: numpy views, ``from_blob``, DLPack). Exact for byte ranges
    that do not meet, for views that differ only by offset (vLLM's K/V halves of one
    cache) and for views that share their outer dimensions and keep their inner parts in
    disjoint ranges of each outer cell (vLLM's CPU pages: K transposed, then V, per block
    and head; ROCM_ATTN's K and V pages of a block). Anything else is reported as not
    provable."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return True
    (a_first, a_end), (b_first, b_end) = byte_span(a), byte_span(b)
    if a_end <= b_first or b_end <= a_first:
        return True
    size = a.element_size()
    if b.element_size() != size or (a_first - b_first) % size:
        return False
    da, db = _dims(a), _dims(b)
    if any(st <= 0 for _, st in da + db):
        return False
    base = min(a_first, b_first)  # first elements, in elements of `size` from the lower one
    a0, b0 = (a_first - base) // size, (b_first - base) // size
    if sorted(da) == sorted(db) and a0 != b0:
        return _nested(da + [(2, abs(b0 - a0))])  # one tensor with a 2-wide dim: a, then b
    shared = sorted((d for d in da if d in db), key=lambda d: -d[1])
    for k in range(len(shared), -1, -1):  # the outermost shared dims first, then fewer
        outer = shared[:k]
        inner_a = [d for d in da if d not in outer]
        inner_b = [d for d in db if d not in outer]
        ia1 = a0 + sum((s - 1) * st for s, st in inner_a)
        ib1 = b0 + sum((s - 1) * st for s, st in inner_b)
        if ia1 < b0 or ib1 < a0:
            cell = max(ia1, ib1) - min(a0, b0) + 1
            if _nested(inner_a) and _nested(inner_b) and _nested(outer, cell):
                return True
    return False


def check_writable(name: str, t: torch.Tensor | PackedCache) -> None:
    """A tensor the call writes: one element per address, outside autograd (the operations
    write in place and have no backward)."""
    t = memory_of(t)
    if t.requires_grad:
        raise ValueError(f"{name}: requires grad; this call writes it in place and has no backward (pass a "
                         "tensor that does not require grad, e.g. a detached one)")
    if internal_overlap(t):
        raise ValueError(f"{name}: a tensor this call writes must not alias itself (an expanded or overlapping "
                         f"view, strides {t.stride()} for shape {list(t.shape)}); pass a tensor with its own "
                         "memory per element")


def check_disjoint(written: str, w: torch.Tensor | PackedCache, other: str, o: torch.Tensor | PackedCache) -> None:
    if not provably_disjoint(memory_of(w), memory_of(o)):
        raise ValueError(f"{written}: shares memory with {other}; the call would overwrite what it reads "
                         f"(pass separate tensors)")


def signature(x: Any) -> tuple:
    """What structural checks read of an argument: a tensor's or packed cache's shape,
    strides, dtype, device and whether it requires grad; a list's or tuple's type and its items' signatures (never
    the tensors themselves: their values are read per call); any other value's type and
    value."""
    if isinstance(x, torch.Tensor):
        return x.shape, x.stride(), x.dtype, x.device, x.requires_grad
    kind = type(x)
    if kind is PackedCache:
        v = x.view
        return PackedCache, v.shape, v.stride(), v.dtype, v.device, v.requires_grad
    if kind is list or kind is tuple:
        return kind, tuple(map(signature, x))
    return kind, x


class Structure:
    """A call's structure (the tuple of its arguments' :func:`signature`), hashed once: it
    keys the structural checks' memo here and, inside a call's planning record, dispatch's
    plan cache."""

    __slots__ = ("parts", "_hash")

    def __init__(self, parts: tuple):
        self.parts = parts
        self._hash = hash(parts)  # TypeError for an unhashable argument: no memo for that call

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Structure) and self._hash == other._hash
                                 and self.parts == other.parts)

    def __repr__(self) -> str:
        return f"Structure({self.parts!r})"


class StructureMemo:
    """What the structural checks derived once per call structure (defaults, constant
    scale tensors). A server makes the same few call
    structures over and over: each is worked out once. Bounded (structures that hold
    addresses, as the precompute's caches do, would otherwise grow it without end); a lost
    race between threads only means working one out twice."""

    def __init__(self, capacity: int = 1024):
        self._capacity = capacity
        self._known: dict[Structure, tuple[Structure, Any]] = {}

    @staticmethod
    def structure(parts: tuple) -> Structure | None:
        try:
            return Structure(parts)
        except TypeError:  # an unhashable argument: checked every time
            return None

    def get(self, key: Structure | None) -> tuple[Structure, Any] | None:
        """``(the remembered equal structure, what its checks derived)`` or None. Handing
        out the remembered object lets later lookups of it compare by identity."""
        return None if key is None else self._known.get(key)

    def __setitem__(self, key: Structure | None, derived: Any) -> None:
        """Remember what the checks of ``key`` derived (an unhashable structure, None: nothing)."""
        if key is None:
            return
        if len(self._known) >= self._capacity:
            self._known.clear()
        self._known[key] = (key, derived)

    def forget(self) -> None:
        self._known.clear()

    def __len__(self) -> int:
        return len(self._known)


def storage_range(t: torch.Tensor | PackedCache) -> tuple[int, int]:
    """The bytes of the storage under ``t``, ``[start, end)``: every element of ``t`` lies
    in them. Cheaper than :func:`byte_span` (no walk over the dimensions)."""
    storage = memory_of(t).untyped_storage()
    start = storage.data_ptr()
    return start, start + storage.nbytes()


def merged_ranges(ranges) -> tuple[tuple[int, int], ...]:
    """Byte ranges ``[start, end)`` sorted and merged where they meet: what
    :func:`storages_meet` tests against."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return tuple(merged)


def storages_meet(tensors: Sequence[torch.Tensor | PackedCache | None], ranges: Sequence[tuple[int, int]]) -> bool:
    """The cheap sufficient test of the overlap checks, run on every call: whether the
    memory of the storage under any of ``tensors`` (None skipped) meets one of ``ranges``
    (:func:`merged_ranges`: sorted and disjoint, so the one range that can meet a storage
    is the first that ends after it starts, found by bisection; their hull is tested first).
    False proves the tensors apart from that memory. Addresses, not storage identities: two
    storages may share memory (numpy views, DLPack)."""
    if not ranges:
        return False
    low, high = ranges[0][0], ranges[-1][1]
    for t in tensors:
        if t is not None:
            storage = (t.view if type(t) is PackedCache else t).untyped_storage()
            start = storage.data_ptr()
            end = start + storage.nbytes()
            if start < high and low < end:
                first = bisect.bisect_right(ranges, start, key=_range_end)
                if first < len(ranges) and ranges[first][0] < end:
                    return True
    return False


_range_end = operator.itemgetter(1)


_LAYOUTS_KEPT = 256
_passed_layouts: dict[tuple, None] = {}


def check_layout_once(tag: str, tensors: Sequence[torch.Tensor | PackedCache], check: Callable[[], None]) -> None:
    """Run ``check`` (which raises on a bad layout) unless these tensors' layout (address,
    shape, strides) already passed it: memory checks are pairwise, and a server's caches
    and buffers never move, so each layout is judged once."""
    key = (tag, *((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in map(memory_of, tensors)))
    if key in _passed_layouts:
        return
    check()
    if len(_passed_layouts) >= _LAYOUTS_KEPT:
        _passed_layouts.clear()
    _passed_layouts[key] = None


# -- values ----------------------------------------------------------------------------------

class IndexChecks:
    """Conditions on tensor values, checked where the values live: on the host for CPU
    tensors (a ValueError naming the first offender), as asynchronous device-side asserts
    for GPU tensors (no sync; the process sees a device-side assert error)."""

    def __init__(self, device: torch.device):
        self.on_host = device.type == "cpu"

    def require(self, ok: torch.Tensor, message: str, offender: Callable[[tuple[int, ...]], str] | None = None):
        """``ok``: a bool tensor, true where the values are valid."""
        if not ok.numel():
            return
        if self.on_host:
            if not bool(ok.all()):
                where = tuple(int(i) for i in torch.nonzero(~ok)[0])
                raise ValueError(offender(where) if offender else message)
        else:
            torch._assert_async(ok.all(), message)

    def require_range(self, values: torch.Tensor, low: int, high: int, message: str,
                      offender: Callable[[tuple[int, ...]], str] | None = None):
        """``low <= values < high`` everywhere: on the host one reduction (its minimum and
        maximum), the offender looked for only when one is out of range (every call of a
        validating plan pays this); on a device, :meth:`require`'s asynchronous assert."""
        if not values.numel():
            return
        if self.on_host:
            lo, hi = torch.aminmax(values)
            if int(lo) < low or int(hi) >= high:
                self.require((values >= low) & (values < high), message, offender)
        else:
            self.require((values >= low) & (values < high), message, offender)


def per_layer(name: str, value: Any, L: int) -> tuple:
    if isinstance(value, torch.Tensor) or isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name}: expected a sequence of num_layers={L} entries, got {type(value).__name__}")
    if len(value) != L:
        raise ValueError(f"{name}: expected num_layers={L} entries; got {len(value)}")
    return tuple(value)


def holds_tensor(value: Any) -> bool:
    """Whether a scale argument is, or lists, a tensor: its values may change between calls
    (vLLM updates scales in place), so it is read at every call, never kept from a check."""
    return isinstance(value, torch.Tensor) or (
        isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value))


def scale_tensor(name: str, value: Any, n: int, device: torch.device) -> torch.Tensor:
    """Cache scales as a contiguous float32 ``[n]`` tensor on ``device``: a float (n == 1),
    a sequence of n floats or one-element tensors, or a float tensor of n elements (vLLM
    passes tensors). Values must be positive and finite: checked on the host for floats,
    by :meth:`IndexChecks.require` for tensors (see :func:`check_scale_values`)."""
    if isinstance(value, torch.Tensor):
        tensor_arg(name, value)
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a float tensor; got {value.dtype}")
        if value.numel() != n:
            raise ValueError(f"{name}: expected {'one scale' if n == 1 else f'one scale per layer, [num_layers={n}]'}; "
                             f"got shape {list(value.shape)}")
        check_device(name, value, device)
        return value.reshape(n).to(torch.float32).contiguous()
    if n == 1 and not isinstance(value, (Sequence, torch.Tensor)):
        # a fill kernel with the value as its argument: no host data crosses to the device
        return torch.full((1,), positive_float(name, value), dtype=torch.float32, device=device)
    items = per_layer(name, value, n)
    return torch.cat([scale_tensor(f"{name}[{i}]", v, 1, device) for i, v in enumerate(items)])


def check_scale_values(name: str, scales: torch.Tensor, checks: IndexChecks) -> None:
    checks.require(torch.isfinite(scales) & (scales > 0), f"{name}: expected positive finite scales",
                   lambda i: f"{name}: expected positive finite scales; got {scales[i].item()} at {list(i)}")
