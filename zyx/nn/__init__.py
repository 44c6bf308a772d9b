"""zyx.nn: layers (torch.nn's names and state_dict keys), functional ops and initializers.

    import zyx
    from zyx import nn
    import zyx.nn.functional as F
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    loss = F.cross_entropy(model(x), y)
"""
from . import functional, init, utils
from . import parallel  # noqa: E402  (DistributedDataParallel)
from .modules import *  # noqa: F401,F403
from .modules import __all__ as _modules_all

__all__ = ["functional", "init", "parallel", "utils"] + list(_modules_all)
