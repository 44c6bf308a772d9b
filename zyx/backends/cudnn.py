"""`zyx.backends.cudnn.allow_tf32`, torch.backends.cudnn's switch under its name, so that a
PyTorch script that sets it runs with its import changed.

PyTorch runs float32 convolutions on TF32 tensor cores by default (cuDNN's
`allow_tf32 = True`), while float32 matrix products stay exact
(`set_float32_matmul_precision("highest")`). zyx does the same: products that read
overlapping windows (convolutions and their gradients, gemm.reads_windows) may use TF32
on GPUs that have it (NVIDIA compute capability 8.0 and later) unless this is False.
Other backends have no TF32 and compute in float32.

The setting lives in the runtime (`Runtime.conv_tf32`, `Runtime.set_conv_tf32`), which
binds itself here when it is made (`bind`): this module imports nothing of zyx."""
import sys
import types

_bound = []      # [getter, setter]: the runtime's, once bound


def bind(get, set_):
    """Read and write `allow_tf32` through `get()` and `set_(value)` (the runtime's)."""
    _bound[:] = [get, set_]


class _CudnnModule(types.ModuleType):
    """This module, with `allow_tf32` read and written through the runtime."""

    @property
    def allow_tf32(self):
        """Whether float32 convolutions may run on TF32 tensor cores (default True, as
        torch's; environment ZYX_CONV_TF32=0 starts with False)."""
        return _bound[0]()

    @allow_tf32.setter
    def allow_tf32(self, value):
        _bound[1](value)


sys.modules[__name__].__class__ = _CudnnModule
