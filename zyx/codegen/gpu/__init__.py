"""The lowering every GPU backend shares: `dispatch.lower` turns a kernel into a
`GPUKernel` (source text and the launches that run it), choosing how its work is spread
over work-groups; `gemm` writes shared-memory tiles for products, `transpose` staged
permuted copies. Vendor-only lowerings (`nvidia/`) are reached through DeviceInfo."""
