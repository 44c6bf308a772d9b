"""zyx.distributed: data-parallel training over several processes, with
torch.distributed's names and behaviour.

    import zyx.distributed as dist
    dist.init_process_group("mpi")          # under `mpirun -np 4 python train.py`
    x = zyx.ones(3) * dist.get_rank()
    dist.all_reduce(x)                      # in place: x is now the sum over the ranks

Backends: "mpi" (mpi4py over the system MPI; CPU tensors, other devices through the host)
and "nccl" (NCCL through ctypes; CUDA tensors, enqueued on zyx's stream). Collectives
take zyx tensors and work in place as in torch: the result becomes the tensor's value
(through zyx's in-place machinery, so views and autograd follow). Every collective first
checks that all ranks passed matching arguments (set_collective_checks), and waits on the
other ranks only up to init_process_group's timeout. See docs/distributed.md.
"""
from .work import DistributedError, ReduceOp, Work
from .group import TCPStore
from .collectives import (
    all_gather, all_gather_into_tensor, all_reduce, all_reduce_as_computed,
    all_reduce_coalesced, barrier, broadcast,
    destroy_process_group, get_backend, get_rank, get_world_size, init_process_group,
    irecv, is_available, is_initialized, is_main_process, is_mpi_available,
    is_nccl_available, isend, recv, reduce_scatter, reduce_scatter_tensor, send,
    set_collective_checks,
)

__all__ = [
    "DistributedError", "ReduceOp", "Work", "TCPStore", "all_gather",
    "all_gather_into_tensor", "all_reduce", "all_reduce_as_computed", "all_reduce_coalesced",
    "barrier", "broadcast",
    "destroy_process_group", "get_backend", "get_rank", "get_world_size",
    "init_process_group", "irecv", "is_available", "is_initialized", "is_main_process",
    "is_mpi_available", "is_nccl_available", "isend", "recv", "reduce_scatter",
    "reduce_scatter_tensor", "send", "set_collective_checks",
]
