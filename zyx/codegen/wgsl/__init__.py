"""WGSL (WebGPU Shading Language) code generation: `writer.write` walks the kernel IR and
returns one compute shader and its dispatch (`WGSLKernel`)."""
from .writer import WGSLKernel, supports, write

__all__ = ["WGSLKernel", "supports", "write"]
