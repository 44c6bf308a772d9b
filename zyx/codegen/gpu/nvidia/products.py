"""What the NVIDIA lowerings offer the shared GPU lowering, through DeviceInfo.

The CUDA backend puts `lower_product` into `DeviceInfo.product_lowerings` and
`k_major_windows` into `DeviceInfo.k_major_windows`; `gemm.lower_gemm` and the layers
above ask DeviceInfo, so nothing outside this package imports it. Which lowering a
product takes (module docstrings of wgmma and mma say why):
1. warpgroup products (`wgmma.lower_wgmma`, Hopper sm_90a, plain 16-bit loads);
2. a convolution's window copied through tensor maps (`wgmma.window_plan`, sm_90a);
3. mma.sync tensor-core products (`mma.lower_mma`, compute capability 8.0 and later);
else None, and gemm writes its float tiles.
"""
from __future__ import annotations

from .. import gemm
from . import mma, wgmma


def lower_product(kernel, dl, info, name, p, tile, var):
    """The `GPUKernel` of gemm plan `p` (tile (rows, cols, K step), gemm knobs `var`) on
    NVIDIA matrix instructions, or None where none of them takes the product."""
    if var["mma"] and wgmma.usable(p, kernel.ops, dl, info, tile, var):
        return wgmma.lower_wgmma(kernel, dl, info, name, p, var)
    window = wgmma.window_plan(p, kernel.ops, dl, info, var)
    if window is not None:
        return wgmma.lower_wgmma_tma(kernel, dl, info, name, window, var)
    if var["mma"] and mma.usable(p, dl, info):
        return mma.lower_mma(kernel, dl, info, name, p, tile, var)
    return None


def k_major_windows(info, dtype):
    """Whether convolution windows of `dtype` on the device `info` describes are copied
    through tensor maps into warpgroup products (Hopper sm_90a with tensor maps), whose
    products read both operands K-major: 16-bit ones, float32 ones the precision
    settings let run on TF32 (zyx.set_float32_matmul_precision, or for convolutions
    zyx.backends.cudnn.allow_tf32), and float32 ones at "highest" on FMA tiles (not with
    the gemm knob "fma=0"). nn.functional then stores such a convolution's weights with
    the input channels innermost."""
    extra = info.extra or {}
    if extra.get("arch") != "sm_90a" or not extra.get("tma"):
        return False
    if dtype.name in ("float16", "bfloat16"):
        return True
    return dtype.name == "float32" and (info.float32_precision != "highest" or info.conv_tf32
                                        or bool(gemm.variant()["fma"]))
