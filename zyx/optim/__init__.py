"""Optimizers and learning-rate schedulers with torch.optim's names and formulas.

    opt = zyx.optim.Adam(model.parameters(), lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()        # torch convention
    opt.update(params, tape.gradient(loss, params))    # zyx convention (Tape)
"""
from .optimizer import Optimizer
from .sgd import SGD
from .adam import Adam, AdamW
from .rmsprop import RMSprop
from . import lr_scheduler
from .lr_scheduler import LRScheduler, StepLR, CosineAnnealingLR

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "lr_scheduler", "LRScheduler",
           "StepLR", "CosineAnnealingLR"]
