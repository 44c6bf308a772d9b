"""Lowering a zyx kernel to a GPU program: the part every GPU backend (OpenCL, CUDA, HIP)
shares. The C-family dialect (cfamily.OpenCLDialect, CUDADialect...) says how things are
spelled; this module decides how the kernel's work is spread over work-groups and
work-items, and returns a `GPUKernel`: one source with one or more entry points and the
launches that run them in order.

A backend's part is then small: compile `GPUKernel.source` once, allocate the scratch
buffers a program asks for, and enqueue each `Launch` with its arguments.

Launch arguments name either one of the zyx kernel's buffers (`("arg", i)`, i.e. the
buffers `Device.launch` receives, output first) or a scratch buffer of the program
(`("scratch", j)`, `GPUKernel.scratch[j]` bytes, contents undefined at entry).
"""
from __future__ import annotations

from .._core import kernel as K
from .cfamily import render_body

WORK_GROUP = 64    # work-items per group of the one-item-per-output frame


class Launch:
    """One kernel launch: entry point `entry`, `groups` work-groups of `local_size`
    work-items (1-D), and its arguments (see the module docstring)."""
    __slots__ = ("entry", "groups", "local_size", "args")

    def __init__(self, entry, groups, local_size, args):
        self.entry = entry
        self.groups = groups
        self.local_size = local_size
        self.args = args

    @property
    def global_size(self):
        return self.groups * self.local_size

    def __repr__(self):
        return f"Launch({self.entry}, {self.groups}x{self.local_size}, {self.args})"


class GPUKernel:
    """The lowered kernel: source text (prelude included), launches in order, scratch
    buffer sizes in bytes."""
    __slots__ = ("source", "launches", "scratch")

    def __init__(self, source, launches, scratch=()):
        self.source = source
        self.launches = launches
        self.scratch = list(scratch)


def _params(kernel, dl, r):
    """Parameter declarations of the zyx kernel's buffers, in argument order."""
    ro = {argno: (d, read_only) for argno, d, read_only in r.params}
    params = []
    for argno in range(len(kernel.args)):
        # an argument no op reads still takes its position in the argument list
        d, read_only = ro.get(argno, (None, True))
        t = dl.storage_type(d) if d is not None else dl.byte_type
        const = "const " if read_only else ""
        params.append(f"{dl.global_qualifier}{const}{t}* {dl.restrict} g{argno}")
    return params


def output_size(r):
    n = 1
    for _, _, length in r.indices:
        n *= length
    return n


def lower(kernel, dl, info=None, name="zyx_k"):
    """`GPUKernel` of `kernel` in dialect `dl` for a device described by `info`
    (DeviceInfo; None for defaults).

    One work-item per element of the flattened output indices (the global size is
    rounded up to whole groups, hence the guard); each runs the kernel's loops and
    reductions serially, like one iteration of the C backend's index loops."""
    r, _ = render_body(kernel, dl)
    n = output_size(r)
    i64 = dl.int64
    head = [f"  const {i64} zyx_gid = ({i64}){dl.group_id(0)} * {dl.local_size(0)} + "
            f"{dl.local_id(0)};",
            f"  if (zyx_gid >= ({i64}){n}) return;"]
    stride = 1
    for ssa, _, length in reversed(r.indices):   # row-major: the last index is fastest
        head.append(f"  const {i64} i{ssa} = (zyx_gid / ({i64}){stride}) % ({i64}){length};")
        stride *= length
    src = (f"{dl.kernel_prefix} {name}({', '.join(_params(kernel, dl, r))}) {{\n"
           + "\n".join(head) + "\n" + "\n".join(r.lines) + "\n}\n")
    groups = max(-(-n // WORK_GROUP), 1)
    args = [("arg", i) for i in range(len(kernel.args))]
    return GPUKernel(dl.prelude + src, [Launch(name, groups, WORK_GROUP, args)])
