"""Shared fixtures for the benchmarks: inputs made once, optional PyTorch peer."""
import numpy as np
import pytest

try:
    import torch
    torch.set_num_threads(max(1, __import__("os").cpu_count() or 1))
except ImportError:  # PyTorch is an optional peer
    torch = None


@pytest.fixture(scope="session")
def rng():
    return np.random.default_rng(0)


def need_torch():
    if torch is None:
        pytest.skip("PyTorch not installed (pip install torch==2.13.0)")
    return torch
