"""``precompute_and_store_context_kv``: every draft layer's K/V of the context states, written
into each layer's paged cache."""

from ...contract import spec_tolerance
from ..base import Op
from .call import PrecomputeCall
from .reference import precompute as reference
from .validation import precompute_call

OP = Op(name="precompute_and_store_context_kv", short="precompute", label="precompute",
        build_call=precompute_call, reference=reference,
        tolerance=lambda call: spec_tolerance(call.dtype, call.cache_dtype))

__all__ = ["OP", "PrecomputeCall", "precompute_call", "reference"]
