"""What code generation knows about the device it writes for: `DeviceInfo`.

A backend describes each of its devices with one DeviceInfo (`Device.info()`, the same
object for the device's lifetime); the kernelizer, the passes and the lowerings read it.
Settings users change at run time (the float32 matmul precision) are written into it by
the runtime, so code generation reads them here and holds no state of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import heuristics

# zyx.set_float32_matmul_precision's values, as PyTorch's setting of that name
FLOAT32_PRECISIONS = ("highest", "high", "medium")


@dataclass
class DeviceInfo:
    """What optimization passes and the scheduler know about a device."""
    name: str = "unknown"
    compute: float = 1e9                  # FLOP/s estimate used to rank devices
    max_global_work_dims: tuple = (2**31 - 1, 65535, 65535)
    max_local_threads: int = 1
    max_local_work_dims: tuple = (1, 1, 1)
    local_mem_size: int = 0
    preferred_vector_size: int = 16       # bytes
    warp_size: int = 1
    num_cores: int = 1
    dtypes: tuple = ()                    # supported dtype names; empty = all
    # the physical device (e.g. its UUID as hex), shared by every API that reaches it
    # (CUDA, Vulkan, ...): the runtime ranks one physical device once, by its fastest API.
    # None: unknown (never merged with another device)
    hardware: str = None
    tensor_cores: bool = False
    # CPU register tiles of reduce kernels (heuristics.choose_upcast's "lanes"/"unroll");
    # GPU devices set False: gpu.lower spreads outputs over work-items instead
    register_tiles: bool = True
    tile_min_outputs: int = 0             # fewest outputs of a kernel given register tiles
    window_tiles: bool = True             # tiles of short windows too (convolutions)
    sum_block: int = 0                    # float sum block (kernelizer; 0: its SUM_BLOCK)
    # (kernel ops) -> True where the backend tiles the kernel itself (GPU gemm tiles):
    # kernelize leaves it without register tiles
    own_tiles: object = None
    # (rows, cols, k, most) -> parts: how many pieces nn.functional cuts a long product's
    # reduce of k terms into (split-K; a divisor of `most`, the batch it splits), each
    # piece a product of its own, then a sum of the pieces. None: never cut (the CPU's
    # register tiles; lowerings whose reduce strategies take long products as they are)
    product_parts: object = None
    # "highest", "high" or "medium" (zyx.set_float32_matmul_precision): whether float32
    # products may run on TF32 tensor cores; written by the runtime
    float32_precision: str = "highest"
    # zyx.backends.cudnn.allow_tf32 (True by default, as torch's): whether float32
    # convolutions (products reading overlapping windows, gemm.reads_windows) may run on
    # TF32 tensor cores whatever float32_precision says; written by the runtime
    conv_tf32: bool = False
    # (kernel, dialect, info, name, gemm plan, tile, gemm knobs) -> GPUKernel or None,
    # tried in order before gemm's float tiles: the device's matrix-instruction products
    # (the CUDA backend: codegen/gpu/nvidia/products.lower_product)
    product_lowerings: tuple = ()
    # (info, dtype) -> bool: convolution windows of that dtype are read K-major (None: no)
    k_major_windows: object = None
    # matrix shapes the device multiplies cooperatively (Vulkan VK_KHR_cooperative_matrix,
    # enabled at device creation): spirv.coopmat.CoopShape tuples (M, N, K, the A, B, C
    # and result dtype names, scope); empty where there are none
    coop_shapes: tuple = ()
    extra: dict = field(default_factory=dict)

    def reads_windows_k_major(self, dtype):
        """Whether this device's lowering copies a convolution's windows of `dtype` into
        products that read both operands K-major (so nn.functional stores the weights
        with the input channels innermost)."""
        return self.k_major_windows is not None and bool(self.k_major_windows(self, dtype))

    def split_k(self, rows, cols, k, most):
        """How many pieces a product of rows x cols outputs over k terms is cut into
        along a batch of `most` (product_parts; 1 where it is None)."""
        return 1 if self.product_parts is None else self.product_parts(rows, cols, k, most)

    def channel_lane_rows(self, n, two_vectors):
        """The rows a channel-lanes register tile (heuristics.channel_lane_rows: lanes over
        a convolution's output channels, one vector of them or two) takes along an output
        axis of length n, 0 for none: nn.functional predicts where the kernelizer puts
        that tile's rows (`_lazy_last_axis`)."""
        return heuristics.channel_lane_rows(n, two_vectors)
