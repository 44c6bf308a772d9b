"""Model files. `zyx.save(state_dict, path)` writes safetensors; `zyx.load(path)` maps a
safetensors file lazily through the disk memory pool (only tensors that are used are read)."""
from .safetensors import (save, load, load_metadata, read_header, SafetensorsError,
                          DTYPE_CODES)

__all__ = ["save", "load", "load_metadata", "read_header", "SafetensorsError", "DTYPE_CODES"]
