"""What a GPU lowering returns and the pieces every strategy writes it with: `GPUKernel`
(source text, launches, scratch buffers), `Launch` (one entry point's grid and
arguments), kernel parameter declarations, the decoding of output indices, work-group
sizes for a device, and the parser of the lowering knobs read from the environment
(`read_variant`)."""
from __future__ import annotations

import os

from ..._core import kernel as K


class Launch:
    """One kernel launch: entry point `entry`, `groups` work-groups of `local_size`
    work-items (1-D), its arguments (see the module docstring), `shared`: bytes of
    dynamic shared memory per group (CUDA only; 0: the kernel declares what it uses), and
    `maps`: tma.TensorMaps passed after the arguments (CUDA only; the driver encodes
    them at launch from the arguments' addresses)."""
    __slots__ = ("entry", "groups", "local_size", "args", "shared", "maps")

    def __init__(self, entry, groups, local_size, args, shared=0, maps=()):
        self.entry = entry
        self.groups = groups
        self.local_size = local_size
        self.args = args
        self.shared = shared
        self.maps = list(maps)

    @property
    def global_size(self):
        return self.groups * self.local_size

    def __repr__(self):
        return f"Launch({self.entry}, {self.groups}x{self.local_size}, {self.args})"


class GPUKernel:
    """The lowered kernel: source text (prelude included), launches in order, scratch
    buffer sizes in bytes, and the strategy's name (for tests and ZYX_DEBUG)."""
    __slots__ = ("source", "launches", "scratch", "strategy", "index_bits", "variant")

    def __init__(self, source, launches, scratch=(), strategy="serial", index_bits=64):
        self.source = source
        self.launches = launches
        self.scratch = list(scratch)
        self.strategy = strategy
        self.index_bits = index_bits
        self.variant = None     # the elementwise or group strategy's knobs, as chosen


def _pow2_floor(n):
    return 1 << (max(int(n), 1).bit_length() - 1)


def _pow2_ceil(n):
    return 1 << (max(int(n), 1) - 1).bit_length()


def local_size_for(info, want):
    """Work-items per group: `want` rounded to a power of two, at most the device's
    limit, at least a warp (32 where the device reports no warp)."""
    top = _pow2_floor(max(info.max_local_threads, 1))
    warp = info.warp_size if info.warp_size > 1 else 32
    return max(min(_pow2_ceil(want), top), min(warp, top))


def device_threads(info):
    """Work-items that keep every compute unit busy (2048 per SM on an H100)."""
    return max(info.num_cores, 1) * max(info.max_local_threads, 1) * 2


def kernel_params(kernel, dl, r):
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


def decode_indices(ops, itype, flat):
    """Statements giving each INDEX variable its value from the flat output index `flat`
    (row-major: the last index is fastest). Every caller has `flat` below the output
    count, so the outermost index needs no `%` (and a stride of 1 no division)."""
    lines, stride = [], 1
    idx = [i for i, op in enumerate(ops) if op[0] == K.INDEX]
    for ssa in reversed(idx):
        length = ops[ssa][3]
        e = flat if stride == 1 else f"({flat} / {stride})"
        if ssa != idx[0]:
            e = f"{e} % {length}"
        lines.append(f"  const {itype} i{ssa} = {e};")
        stride *= length
    return list(reversed(lines))


def entry_source(dl, name, params, head, body):
    """One entry point's source."""
    return (f"{dl.kernel_prefix} {name}({', '.join(params)}) {{\n" + "\n".join(head)
            + "\n" + "\n".join(body) + "\n}\n")


def read_variant(env, defaults, limits, spec):
    """`defaults` updated by `spec`, a "key=value,..." string (None: the environment
    variable `env`, read at every lowering so that one machine can compare variants);
    the keys in `limits` must be powers of two up to their limit (0 allowed where the
    default is 0: "automatic")."""
    spec = os.environ.get(env, "") if spec is None else spec
    out = dict(defaults)
    example = ",".join(f"{k}={v}" for k, v in defaults.items())
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        key, sep, val = part.partition("=")
        if key not in out or not sep or not val.isdigit():
            raise ValueError(f"{env}={spec!r}: cannot read {part!r} (keys {', '.join(out)}, "
                             f"e.g. \"{example}\")")
        out[key] = int(val)
    for key, top in limits.items():
        v = out[key]
        if v == 0 and defaults[key] == 0:
            continue
        if v < 1 or v & (v - 1) or v > top:
            raise ValueError(f"{env}={spec!r}: {key} must be a power of two from 1 to {top}")
    return out
