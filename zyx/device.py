"""Device names with PyTorch's spelling: `zyx.device("cuda:0")`, `x.device`, `zyx.devices()`.

A `Device` names a place tensors live and compute: a type (`cpu`, `cuda`, `opencl`, `hip`,
`dummy`) and an index among the devices of that type. The C backend is `cpu` (one device,
no index, as in torch); the GPU backends number their devices from 0 in the order their
driver lists them. The runtime maps a Device to its backend device (`Runtime.resolve`).
"""
from __future__ import annotations

# backend module name -> device type users write
BACKEND_TYPES = {"c": "cpu", "opencl": "opencl", "cuda": "cuda", "hip": "hip",
                 "vulkan": "vulkan", "wgpu": "wgpu", "dummy": "dummy"}
TYPES = tuple(BACKEND_TYPES.values())


class Device:
    """A device name: `type` and `index` (None: the type's first device, e.g. "cuda").

    Compares equal to another Device or to a string naming the same device ("cuda:0");
    `zyx.devices()` returns Devices that also carry what the runtime found: `backend`,
    `name`, `memory` (bytes) and `compute` (FLOP/s estimate used to rank them)."""
    __slots__ = ("type", "index", "backend", "name", "memory", "compute")

    def __init__(self, type, index=None):
        if isinstance(type, Device):
            type, index = type.type, type.index if index is None else index
        elif not isinstance(type, str):
            raise TypeError(f"device() expects a string such as 'cuda:0', got "
                            f"{type.__class__.__name__}")
        else:
            spec = type.strip()
            if ":" in spec:
                if index is not None:
                    raise ValueError(f"device {spec!r} has an index; do not pass another")
                spec, _, idx = spec.partition(":")
                if not idx.isdigit():
                    raise ValueError(f"invalid device string {type!r}: the index after ':' "
                                     "must be a non-negative integer")
                index = int(idx)
            type = spec
        if type not in TYPES:
            raise ValueError(f"unknown device type {type!r}; expected one of "
                             f"{', '.join(TYPES)} (optionally with ':<index>')")
        if index is not None and (isinstance(index, bool) or not isinstance(index, int)
                                  or index < 0):
            raise ValueError(f"device index must be a non-negative integer, got {index!r}")
        self.type = type
        self.index = index
        self.backend = self.name = None
        self.memory = self.compute = None

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self):
        if self.name is None:
            return f"device(type='{self.type}'" + (
                f", index={self.index})" if self.index is not None else ")")
        mem = f", {self.memory / 2**30:.1f} GiB" if self.memory else ""
        return f"device('{self}': {self.name}{mem})"

    def __eq__(self, other):
        if isinstance(other, str):
            try:
                other = Device(other)
            except (TypeError, ValueError):
                return False
        if not isinstance(other, Device):
            return NotImplemented
        return self.type == other.type and self.index == other.index

    def __hash__(self):
        return hash((self.type, self.index))


def device(type, index=None) -> Device:
    """A device name, torch.device's spelling: `device("cuda")`, `device("cuda:1")`,
    `device("opencl", 0)`, `device("cpu")`."""
    return Device(type, index)
