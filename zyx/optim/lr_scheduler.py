"""Learning-rate schedulers (torch.optim.lr_scheduler formulas).

A scheduler writes `group["lr"]`; the optimizer turns each lr value into a 0-d leaf tensor,
so a new learning rate never compiles a new kernel."""
from __future__ import annotations

import math

from .optimizer import Optimizer


class LRScheduler:
    """Base: `step()` advances `last_epoch` and sets each group's lr from `get_lr()`."""

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for i, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise KeyError(f"param_groups[{i}] has no 'initial_lr' to resume from "
                                   f"(last_epoch={last_epoch})")
        self.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._step_count = 0
        self.step()

    def get_lr(self):
        raise NotImplementedError

    def get_last_lr(self):
        """The learning rates the last step() set, one per parameter group."""
        return list(self._last_lr)

    def step(self, epoch=None):
        self._step_count += 1
        if epoch is None:
            self.last_epoch += 1
            values = self.get_lr()
        else:
            self.last_epoch = epoch
            values = self._closed_form_lr() if hasattr(self, "_closed_form_lr") else self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self):
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state):
        self.__dict__.update(state)


class StepLR(LRScheduler):
    """Multiply the lr by `gamma` every `step_size` epochs."""

    def __init__(self, optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        groups = self.optimizer.param_groups
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return [g["lr"] for g in groups]
        return [g["lr"] * self.gamma for g in groups]

    def _closed_form_lr(self):
        return [b * self.gamma ** (self.last_epoch // self.step_size) for b in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """eta_min + (base_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2, computed
    recursively like torch (so external lr changes are respected)."""

    def __init__(self, optimizer, T_max: int, eta_min: float = 0.0,  # noqa: N803
                 last_epoch: int = -1):
        self.T_max = T_max
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        groups = self.optimizer.param_groups
        e, t, lo = self.last_epoch, self.T_max, self.eta_min
        if e == 0:
            return [g["lr"] for g in groups]
        if self._step_count == 1 and e > 0:
            return [lo + (b - lo) * (1 + math.cos(e * math.pi / t)) / 2 for b in self.base_lrs]
        if (e - 1 - t) % (2 * t) == 0:
            return [g["lr"] + (b - lo) * (1 - math.cos(math.pi / t)) / 2
                    for b, g in zip(self.base_lrs, groups)]
        return [(1 + math.cos(math.pi * e / t)) / (1 + math.cos(math.pi * (e - 1) / t))
                * (g["lr"] - lo) + lo for g in groups]

    def _closed_form_lr(self):
        return [self.eta_min + (b - self.eta_min) * (1 + math.cos(math.pi * self.last_epoch
                                                                  / self.T_max)) / 2
                for b in self.base_lrs]
