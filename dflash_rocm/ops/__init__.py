"""The package's operations, one small package each; ``OPS`` maps public names to records."""

from . import attention, precompute
from .base import Op

ATTENTION: Op = attention.OP
PRECOMPUTE: Op = precompute.OP
OPS: dict[str, Op] = {op.name: op for op in (ATTENTION, PRECOMPUTE)}


def op_named(name: str) -> Op:
    """The op record for a public name, or a ValueError listing the names."""
    try:
        return OPS[name]
    except (KeyError, TypeError):
        raise ValueError(f"op: expected one of {', '.join(OPS)}; got {name!r}") from None


__all__ = ["ATTENTION", "OPS", "PRECOMPUTE", "Op", "op_named"]
