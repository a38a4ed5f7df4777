"""The argument checks both operations share; each op's ``validation`` module builds on them.

Every check runs before anything is written. Two tiers: structural checks (types, dtypes, shapes, devices) cost nothing and always
run; index checks read tensor values (block ids, slots, positions, ``q_len <= seq_len``)
and therefore sync with the device. A caller that has already checked its indices
(the vLLM plugin, on its hot path) passes ``validate=False`` to skip the second tier
only. Every message names the argument, what was expected and what was received.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import torch



def tensor_arg(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name}: expected dtype {names}; got {str(t.dtype).replace('torch.', '')}")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None], words: str) -> None:
    if t.dim() != len(expected) or any(e is not None and s != e for s, e in zip(t.shape, expected)):
        shown = [("?" if e is None else e) for e in expected]
        raise ValueError(f"{name}: expected shape {words} = {shown}; got {list(t.shape)}")


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where query/context_states are); got {t.device}")


def scale_tensor(name: str, value: Any, device: torch.device) -> torch.Tensor:
    """A cache scale as a float32 one-element tensor on ``device`` (vLLM passes tensors)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.dtype.is_floating_point:
            raise ValueError(f"{name}: expected a float scalar or one-element float tensor; "
                             f"got shape {list(value.shape)} {value.dtype}")
        check_device(name, value, device)
        return value.reshape(1).to(torch.float32)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}: expected a positive finite scale, got {value}")
        return torch.tensor([float(value)], dtype=torch.float32, device=device)
    raise TypeError(f"{name}: expected a float or a one-element tensor, got {type(value).__name__}")


def per_layer(name: str, value: Any, L: int) -> tuple:
    if isinstance(value, torch.Tensor) or isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name}: expected a sequence of num_layers={L} entries, got {type(value).__name__}")
    if len(value) != L:
        raise ValueError(f"{name}: expected num_layers={L} entries; got {len(value)}")
    return tuple(value)


def layer_scales(name: str, value: Any, L: int, device: torch.device) -> torch.Tensor:
    if value is None:
        return torch.ones(L, dtype=torch.float32, device=device)
    if isinstance(value, torch.Tensor):
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a float tensor; got {value.dtype}")
        if value.numel() != L:
            raise ValueError(f"{name}: expected one scale per layer, [num_layers={L}]; got {list(value.shape)}")
        check_device(name, value, device)
        return value.reshape(L).to(torch.float32)
    scales = [scale_tensor(f"{name}[{i}]", s, device) for i, s in enumerate(per_layer(name, value, L))]
    return torch.cat(scales)


