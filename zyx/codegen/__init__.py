"""Code generation: a kernel's IR (zyx._core.kernel) in, program text out.

Nothing here talks to a driver or holds global state: what a module needs to know about
the device comes in a `target.DeviceInfo`, and settings the user changes at run time
(the float32 matmul precision) are written into that DeviceInfo by the runtime.

- `target`: DeviceInfo, what code generation knows about a device.
- `heuristics`: tile / lane / unroll choices, the register layouts the kernelizer gives
  reduce kernels.
- `cstyle`: the one renderer of the C family (C, OpenCL C, CUDA C, HIP) and its dialects.
- `cpu/`: IR rewrites the C backend runs before rendering.
- `gpu/`: the lowering every GPU backend shares (work spread over groups, shared-memory
  product tiles, transposes); `gpu/nvidia/` holds what only NVIDIA GPUs run (tensor-core
  products, tensor maps), reached through DeviceInfo, never imported by `gpu/` itself.
"""
