"""torch.cuda's memory and device queries with their names, for CUDA devices
(`zyx.cuda.memory_allocated()`...): a PyTorch script keeps its calls. `device` takes what
torch's does: None (the first CUDA device), an index, or a name such as "cuda:1". The
device-generic forms are zyx.memory_allocated, zyx.memory_reserved and zyx.empty_cache."""
from __future__ import annotations

from .runtime import RT


def _name(device):
    """The device name torch's `device` argument means."""
    if device is None:
        return "cuda"
    if isinstance(device, int) and not isinstance(device, bool):
        return f"cuda:{device}"
    return device


def device_count():
    """Number of CUDA devices zyx found (0 without a driver or GPU)."""
    return sum(1 for d in RT.names() if d.type == "cuda")


def is_available():
    """True when zyx found a CUDA device."""
    return device_count() > 0


def memory_allocated(device=None):
    """Bytes of live tensors (and plan buffers) on the CUDA device."""
    return RT.memory_allocated(_name(device))


def memory_reserved(device=None):
    """memory_allocated plus the freed blocks the device's pool keeps for reuse."""
    return RT.memory_reserved(_name(device))


def empty_cache():
    """Give every CUDA device's kept free blocks back to the driver."""
    for d in RT.names():
        if d.type == "cuda":
            RT.empty_cache(str(d))


def synchronize(device=None):
    """Wait for the work queued on the CUDA device (torch.cuda.synchronize)."""
    RT.synchronize(_name(device))
