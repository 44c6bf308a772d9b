"""zyx.nn.parallel: DistributedDataParallel (torch.nn.parallel's name)."""
from .distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
