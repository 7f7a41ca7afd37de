"""From what a trainer passes to ``commit`` to a checked list of tensors: the torch side of the format.

Validation happens here, on the caller's thread and before any byte is written, so bad input
raises at ``commit`` with nothing written.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .errors import InvalidArgumentError, InvalidNameError, InvalidTensorError
from .format import TensorSpec
from .validate import check_name

__all__ = ["TORCH_TO_ST", "ST_TO_TORCH", "Collected", "collect"]

#: torch dtype -> safetensors dtype name, for every dtype both support.
TORCH_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
ST_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in TORCH_TO_ST.items()}

_RESERVED = {"__metadata__"}
_dtensor_warned = False


@dataclass(frozen=True)
class Collected:
    """A validated state dict: specs and source tensors in order, plus tied names."""

    specs: list[TensorSpec]
    sources: list[torch.Tensor]
    aliases: dict[str, str]  # tied name -> the name stored


def _as_plain_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidTensorError(f"{name!r} is a {type(value).__name__}, not a torch.Tensor")
    if _is_dtensor(value):
        global _dtensor_warned
        if not _dtensor_warned:
            _dtensor_warned = True
            warnings.warn(
                "committing a DTensor gathers it with full_tensor() on every rank; "
                "sharded commits are not supported yet",
                UserWarning,
                stacklevel=4,
            )
        value = value.full_tensor()
    if value.is_meta:
        raise InvalidTensorError(f"{name!r} is a meta tensor: it has no data to store")
    if value.layout != torch.strided:
        raise InvalidTensorError(f"{name!r} has layout {value.layout}; only dense tensors can be stored (use .to_dense())")
    if value.is_quantized:
        raise InvalidTensorError(f"{name!r} is a quantized tensor; store its int_repr() and scales instead")
    if value.dtype not in TORCH_TO_ST:
        raise InvalidTensorError(
            f"{name!r} has dtype {value.dtype}, which safetensors cannot store; "
            f"supported: {', '.join(str(d) for d in TORCH_TO_ST)}"
        )
    return value.detach()


def _is_dtensor(value: torch.Tensor) -> bool:
    # A value can only be a DTensor if its module was imported; importing it here would cost the
    # caller ~0.6 s on the first commit.
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(value, mod.DTensor)


def _items(model: Any) -> list[tuple[Any, Any]]:
    if isinstance(model, torch.nn.Module):
        return list(model.state_dict(keep_vars=False).items())
    if isinstance(model, Mapping):
        return list(model.items())
    raise InvalidArgumentError(
        f"model must be a torch.nn.Module or a mapping of names to tensors, got {type(model).__name__}"
    )


def collect(model: Any) -> Collected:
    """Validate ``model`` and list its tensors; tensors sharing one storage become aliases.

    Of a group of tied names, the smallest name is stored and the others alias it, so the version
    digest does not depend on the order of the state dict.

    Raises InvalidArgumentError, InvalidNameError or InvalidTensorError.
    """
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[tuple, list[str]] = {}
    for name, value in _items(model):
        check_name(name)
        if name in _RESERVED:
            raise InvalidNameError(f"{name!r} is reserved by the safetensors format")
        t = _as_plain_tensor(name, value)
        tensors[name] = t
        if t.numel() > 0:
            # Tied weights: the very same view of the very same storage.
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
                   t.dtype, t.is_conj(), t.is_neg())
            groups.setdefault(key, []).append(name)
    if not tensors:
        raise InvalidArgumentError("model has no tensors to commit")
    aliases = {n: min(names) for names in groups.values() if len(names) > 1 for n in names if n != min(names)}
    kept = [(n, t) for n, t in tensors.items() if n not in aliases]
    return Collected([TensorSpec(n, TORCH_TO_ST[t.dtype], tuple(t.shape)) for n, t in kept],
                     [t for _, t in kept], aliases)
