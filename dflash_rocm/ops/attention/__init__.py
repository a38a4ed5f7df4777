"""``draft_attention``: the query block of each request attending to its paged KV cache."""

from ...contract import spec_tolerance
from ..base import Op
from .call import AttentionCall, AttentionSpec
from .reference import attention as reference
from .validation import attention_call

OP = Op(name="draft_attention", short="attention", label="draft_attention",
        build_call=attention_call, reference=reference,
        tolerance=lambda call: spec_tolerance(call.dtype, call.cache_dtype))

__all__ = ["OP", "AttentionCall", "AttentionSpec", "attention_call", "reference"]
