"""Resolve the configured tensor device (``cpu``, ``cuda[:n]``, ``auto``)."""

from __future__ import annotations

import torch


def resolve_device(spec: str | torch.device | None = "cpu") -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without it fails loudly here,
    at configuration time, rather than on the first allocation deep inside a worker."""
    if spec is None:
        return torch.device("cpu")
    if isinstance(spec, torch.device):
        device = spec
    elif spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(spec)  # raises RuntimeError for unknown device strings
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {str(device)!r} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported route device {str(device)!r}; expected cpu, cuda or auto")
    return device
