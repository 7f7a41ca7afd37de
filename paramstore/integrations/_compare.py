"""Installed equals committed: the bit-for-bit comparison the integrations' install checks share
(verl's ``check_installed``, vLLM's ``verify_paramstore``, SGLang's ``check_installed``)."""

from __future__ import annotations

import torch

__all__ = ["differs"]


def differs(have: torch.Tensor | None, want: torch.Tensor) -> str:
    """``''`` when ``have`` (the engine's tensor) holds exactly the bytes of ``want`` (the version's,
    or what the loader placed), else why not.

    Example:
        >>> from paramstore.integrations._compare import differs
        >>> a = torch.arange(4.0)
        >>> differs(a, a.clone()), differs(a, a + torch.tensor([0.0, 0.0, 0.0, 1.0]))
        ('', '1 of 4 elements differ')
        >>> differs(None, a), differs(a.half(), a)
        ('absent from the engine', 'engine (4,) torch.float16, version (4,) torch.float32')
    """
    if have is None:
        return "absent from the engine"
    if have.shape != want.shape or have.dtype != want.dtype:
        return f"engine {tuple(have.shape)} {have.dtype}, version {tuple(want.shape)} {want.dtype}"
    a = have.detach().to(want.device).contiguous().reshape(-1).view(torch.uint8)
    b = want.detach().contiguous().reshape(-1).view(torch.uint8)
    if torch.equal(a, b):
        return ""
    size = have.element_size()
    n = int((a != b).view(-1, size).any(1).sum()) if size else 0
    return f"{n} of {have.numel()} elements differ"
