"""torch.distributed's functions on zyx tensors: the process group's life cycle and the
collectives, each checked against the other ranks' arguments before any data moves."""
from __future__ import annotations

import os
import zlib

import numpy as np

from .. import dtype as dt
from ..runtime import RT
from ..tensor import Tensor
from .group import ProcessGroup, State, TCPStore, as_seconds, env_rank_world, launched_by_mpi
from .work import (DistributedError, ReduceOp, REDUCE_OPS, Work, completed_work, plain,
                   set_value, sole_owner)

_KINDS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
          "reduce_scatter", "reduce_scatter_tensor", "send/recv", "all_reduce_coalesced")
_DT_CODES = {d: i for i, d in enumerate((dt.float32, dt.float64, dt.float16, dt.bfloat16,
                                         dt.int32, dt.int64, dt.int8, dt.uint8, dt.bool_,
                                         dt.int16))}
_DT_BY_CODE = {i: d for d, i in _DT_CODES.items()}
_OP_CODES = {op.name: i for i, op in enumerate(REDUCE_OPS)}
_META = 14     # kind, op, root, dtype, ndim, 8 dims, shape hash

_checks = [os.environ.get("ZYX_DISTRIBUTED_CHECKS", "1") not in ("0", "off", "false")]


def set_collective_checks(on: bool) -> None:
    """Turn the cross-rank argument check on (the default) or off. On, each collective
    first exchanges a 14-integer description of every rank's tensor (its kind, op, root,
    dtype and shape) and raises DistributedError on every rank when they differ, instead
    of hanging or writing past a buffer; it costs one small all-gather (see
    benches/dist_allreduce.py). Also `ZYX_DISTRIBUTED_CHECKS=0` in the environment."""
    _checks[0] = bool(on)


# -- the process group ------------------------------------------------------------------

def is_available() -> bool:
    """True: zyx.distributed is part of every zyx (backends load when used)."""
    return True


def is_mpi_available() -> bool:
    """True when mpi4py (and an MPI library under it) can be imported."""
    try:
        import mpi4py  # noqa: F401
        return True
    except ImportError:
        return False


def is_nccl_available() -> bool:
    """True when libnccl can be loaded."""
    from .nccl import available
    return available()


def is_initialized() -> bool:
    """True between init_process_group and destroy_process_group."""
    return State.group is not None


def _need(what):
    g = State.group
    if g is None:
        raise DistributedError(f"Default process group has not been initialized, please "
                               f"make sure to call init_process_group. (zyx.distributed."
                               f"{what})")
    return g


def _check_group(group):
    if group is not None and group is not State.group:
        raise DistributedError("zyx.distributed supports only the default process group "
                               "(group=None)")


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                       rank=-1, store=None, group_name="", device_id=None):
    """Join the default process group (torch.distributed.init_process_group).

    backend: "mpi" (CPU tensors, and others through the host; needs mpi4py and a launch
    by mpirun/mpiexec/srun) or "nccl" (CUDA tensors; needs libnccl). None picks "mpi".
    Rank and world size come from the arguments, else from the environment: torchrun's
    RANK/WORLD_SIZE/LOCAL_RANK, else the MPI launcher's (OMPI_COMM_WORLD_*, PMI_*,
    PMIX_*, SLURM_*). init_method "env://" (the default) has nccl ranks meet at
    MASTER_ADDR:MASTER_PORT; "tcp://host:port" names the place directly; under an MPI
    launcher with mpi4py installed they meet through MPI instead. `timeout` (a timedelta
    or seconds, default 5 minutes): how long any collective or the rendezvous waits for the
    other ranks before raising DistributedError. nccl binds to `device_id` (a device name
    or index), else cuda:<LOCAL_RANK>, and makes it zyx's default device."""
    if State.group is not None:
        raise DistributedError("trying to initialize the default process group twice!")
    backend = (backend or "mpi").lower()
    secs = as_seconds(timeout)
    env = env_rank_world()
    local_rank = env[2] if env else 0
    if rank is None or rank < 0:
        rank = env[0] if env else None
    if world_size is None or world_size < 0:
        world_size = env[1] if env else None
    if backend == "mpi":
        from .mpi import MpiBackend
        b = MpiBackend(secs)
        if (world_size is not None and world_size != b.size) or \
                (rank is not None and rank != b.rank):
            raise DistributedError(
                f"the mpi backend takes rank and world size from the MPI launcher (rank "
                f"{b.rank} of {b.size}), but rank={rank} world_size={world_size} were "
                "given: launch with mpirun -np N instead of torchrun")
        State.group = ProcessGroup(b, "mpi", b.rank, b.size, local_rank, secs)
        return
    if backend != "nccl":
        raise DistributedError(f"unknown backend {backend!r}: zyx.distributed has 'mpi' "
                               "and 'nccl'")
    if rank is None or world_size is None:
        if launched_by_mpi() or is_mpi_available():
            from mpi4py import MPI
            rank, world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        else:
            raise DistributedError("init_process_group('nccl'): no RANK/WORLD_SIZE in the "
                                   "environment (launch with torchrun or mpirun) and none "
                                   "given")
    from . import nccl
    uid = _share_unique_id(nccl, rank, world_size, init_method, store, secs)
    if device_id is None:
        device = f"cuda:{local_rank}"
    elif isinstance(device_id, int):
        device = f"cuda:{device_id}"
    else:
        device = str(device_id)
    RT.set_default_device(device)
    b = nccl.NcclBackend(uid, rank, world_size, device, secs)
    State.group = ProcessGroup(b, "nccl", rank, world_size, local_rank, secs)


def _share_unique_id(nccl, rank, world_size, init_method, store, secs):
    """Rank 0's NCCL unique id, read by every rank: through `store`, MPI (under an MPI
    launcher) or a TCPStore at init_method / MASTER_ADDR:MASTER_PORT."""
    if world_size == 1:
        return nccl.new_unique_id()
    if store is None and launched_by_mpi() and is_mpi_available() and \
            (init_method is None or init_method == "env://") and \
            "MASTER_ADDR" not in os.environ:
        from mpi4py import MPI
        uid = nccl.new_unique_id() if rank == 0 else None
        return MPI.COMM_WORLD.bcast(uid, root=0)
    if store is None:
        if init_method and init_method.startswith("tcp://"):
            host, port = init_method[len("tcp://"):].rsplit(":", 1)
        else:
            host = os.environ.get("MASTER_ADDR")
            port = os.environ.get("MASTER_PORT")
            if host is None or port is None:
                raise DistributedError("init_process_group('nccl', init_method='env://') "
                                       "needs MASTER_ADDR and MASTER_PORT in the environment")
        store = TCPStore(host, int(port), world_size, rank == 0, secs)
        State.own_store = store
    if rank == 0:
        store.set("zyx/nccl_unique_id", nccl.new_unique_id())
    return store.get("zyx/nccl_unique_id")


def destroy_process_group(group=None) -> None:
    """Leave the process group (frees the communicator); init_process_group may follow."""
    _check_group(group)
    g = _need("destroy_process_group")
    State.group = None
    g.backend.destroy()
    own = getattr(State, "own_store", None)
    if own is not None:
        State.own_store = None
        own.close()


def get_rank(group=None) -> int:
    """This process's rank in the default group."""
    _check_group(group)
    return _need("get_rank").rank


def get_world_size(group=None) -> int:
    """The number of processes in the default group."""
    _check_group(group)
    return _need("get_world_size").size


def get_backend(group=None) -> str:
    """"mpi" or "nccl"."""
    _check_group(group)
    return _need("get_backend").name


def is_main_process() -> bool:
    """True on rank 0, and when no process group is initialized (a single process): the
    one that writes checkpoints and logs (`if dist.is_main_process(): zyx.save(...)`)."""
    return State.group is None or State.group.rank == 0


def barrier(group=None, async_op=False, device_ids=None):
    """Wait until every rank got here (raises DistributedError after the timeout)."""
    _check_group(group)
    return _need("barrier").backend.barrier(async_op)


# -- checks --------------------------------------------------------------------------------

_described = {}     # (kind, op, root, dtype, shape) -> its description (read-only)


def _describe(kind, t, op=None, root=-1):
    """The 14 integers a rank's call is checked by; made once per distinct call (a
    training loop repeats the same few), so the check costs a dict lookup here."""
    return _described_as(kind, t.dtype, tuple(t.shape), op, root)


def _described_as(kind, dtype, shape, op, root, salt=0):
    key = (kind, op, root, dtype, shape, salt)
    meta = _described.get(key)
    if meta is None:
        if len(_described) > 4096:
            _described.clear()
        meta = _described[key] = _make_description(kind, dtype, shape, op, root, salt)
    return meta


def _make_description(kind, dtype, shape, op, root, salt=0):
    meta = np.zeros(_META, dtype=np.int64)
    meta[0] = _KINDS.index(kind)
    meta[1] = -1 if op is None else _OP_CODES[op.name]
    meta[2] = root
    meta[3] = _DT_CODES.get(dtype, 99)
    meta[4] = len(shape)
    meta[5:5 + min(len(shape), 8)] = shape[:8]
    meta[13] = hash((shape, salt)) & 0x7FFFFFFFFFFFFFFF
    meta.flags.writeable = False
    return meta


def _text(row):
    kind = _KINDS[row[0]] if 0 <= row[0] < len(_KINDS) else f"collective {row[0]}"
    d = _DT_BY_CODE.get(int(row[3]))
    shape = tuple(int(x) for x in row[5:5 + min(int(row[4]), 8)])
    more = ", ..." if row[4] > 8 else ""
    extra = ""
    if row[1] >= 0:
        extra += f" op={REDUCE_OPS[row[1]].name}"
    if row[2] >= 0:
        extra += f" root={row[2]}"
    name = d.name if d else ("mixed dtypes" if row[3] == 99 else "?")
    return f"{kind}({name} {shape}{more}{extra})"


def _agree(g, kind, t, op=None, root=-1, meta=None):
    if not _checks[0] or g.size == 1:
        return
    if meta is None:
        meta = _describe(kind, t, op, root)
    rows = g.backend.allgather_meta(meta, f"{kind} (its cross-rank argument check)")
    if (rows == rows[0]).all():
        return
    parts = [f"rank {r}: {_text(row)}" for r, row in enumerate(rows)]
    raise DistributedError(f"zyx.distributed.{kind}: the ranks passed different arguments "
                           f"(shapes, dtypes, ops or roots must match): " + "; ".join(parts))


def _tensor(t, what):
    if not isinstance(t, Tensor):
        raise TypeError(f"zyx.distributed.{what} expects a zyx Tensor, got "
                        f"{type(t).__name__}")
    return t


def _reduce_op(op):
    if op not in REDUCE_OPS:
        raise DistributedError(f"unknown reduce op {op!r}: use zyx.distributed.ReduceOp")
    return op


# -- collectives ---------------------------------------------------------------------------

def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Combine `tensor` over all ranks with `op`, in place: every rank's tensor becomes
    the result. With async_op=True returns a work handle: call `wait()` before reading."""
    _check_group(group)
    g = _need("all_reduce")
    _tensor(tensor, "all_reduce")
    _agree(g, "all_reduce", tensor, _reduce_op(op))
    return g.backend.all_reduce(tensor, op, async_op)


def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False):
    """all_reduce of every tensor in `tensors` (torch's name), in place, with one
    cross-rank argument check for the whole list instead of one per tensor (the list's
    shapes and dtypes must match across ranks). Each reduction starts at once; with
    async_op=True returns one work handle whose wait() waits for them all."""
    g, tensors = _coalesced(tensors, op, group, "all_reduce_coalesced")
    if not tensors:
        return completed_work() if async_op else None
    works = [g.backend.all_reduce(t, op, True) for t in tensors]
    work = _all_of(works)
    if async_op:
        return work
    work.wait()
    return None


def all_reduce_as_computed(tensors, op=ReduceOp.SUM, group=None, check=True):
    """Compute `tensors` (lazy tensors, such as DistributedDataParallel's flat gradient
    buckets) in one realization and all-reduce each in place, starting each reduction as
    soon as the kernel computing that tensor is queued rather than after the whole
    realization. With the nccl backend the reductions run on a stream of their own, so
    the first tensors' transfers overlap the kernels computing the later ones (list them
    in the order they can be computed, as backward produces gradients). With mpi the
    reductions start once the realization ran (the C backend computes it in one call).

    One cross-rank argument check covers the list, as all_reduce_coalesced (`check=False`
    skips it: a caller whose list never changes, DistributedDataParallel, checks once; a
    check waits for the device's queued work before the realization starts). Returns a
    work handle: call wait() before reading the tensors; with nccl it makes the work
    queued afterwards on the device wait for the reductions, without blocking the host
    (a host wait, such as reading a value, is guarded by the timeout)."""
    g, tensors = _coalesced(tensors, op, group, "all_reduce_as_computed", check)
    start = getattr(g.backend, "start_all_reduce", None)
    if not tensors:
        return completed_work()
    if start is None:
        RT.realize([t._id for t in tensors])
        return _all_of([g.backend.all_reduce(t, op, True) for t in tensors])
    for t in tensors:
        g.backend.dtype_code(t.dtype)        # refused before anything runs
    jobs = []

    def ready_of(t):
        alone = plain(t)

        def ready(buffer, fresh):
            # computed into a buffer of its own, or computed before and held by t alone
            in_place = (fresh and alone) or sole_owner(t)
            jobs.append((t, start(buffer, t.numel(), t.dtype, op, in_place)))
        return ready
    RT.realize([t._id for t in tensors], ready={t._id: ready_of(t) for t in tensors})

    def join(timeout=None):
        for t, job in jobs:
            job.join()
            if job.result is not None:
                set_value(t, job.result)
    return Work(lambda: all(job.is_done() for _, job in jobs), join)


def _coalesced(tensors, op, group, kind, check=True):
    """The group and the list of a coalesced all-reduce, checked across the ranks."""
    _check_group(group)
    g = _need(kind)
    tensors = [_tensor(t, kind) for t in tensors]
    _reduce_op(op)
    if not tensors or not check:
        return g, tensors
    dtypes = tuple(t.dtype for t in tensors)
    same = all(d is dtypes[0] for d in dtypes)
    meta = _described_as("all_reduce_coalesced", dtypes[0] if same else None,
                         tuple(t.numel() for t in tensors), op, -1,
                         0 if same else zlib.crc32(",".join(d.name for d in dtypes).encode()))
    _agree(g, "all_reduce_coalesced", None, op, meta=meta)
    return g, tensors


def _all_of(works):
    """One work handle over several: done when all are, wait() waits for each."""
    return Work(lambda: all(w.is_completed() for w in works),
                lambda timeout: [w.wait(timeout) for w in works])


def broadcast(tensor, src, group=None, async_op=False):
    """Rank `src`'s tensor becomes every rank's, in place."""
    _check_group(group)
    g = _need("broadcast")
    _tensor(tensor, "broadcast")
    if not 0 <= src < g.size:
        raise DistributedError(f"broadcast: src {src} is not a rank of a world of {g.size}")
    _agree(g, "broadcast", tensor, root=src)
    return g.backend.broadcast(tensor, src, async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """tensor_list[i] (world-size tensors shaped like `tensor`) becomes rank i's tensor."""
    _check_group(group)
    g = _need("all_gather")
    _tensor(tensor, "all_gather")
    if len(tensor_list) != g.size:
        raise DistributedError(f"all_gather: tensor_list has {len(tensor_list)} tensors, "
                               f"the world {g.size} ranks")
    for o in tensor_list:
        if tuple(_tensor(o, "all_gather").shape) != tuple(tensor.shape):
            raise DistributedError(f"all_gather: an output of shape {tuple(o.shape)} for "
                                   f"an input of shape {tuple(tensor.shape)}")
    _agree(g, "all_gather", tensor)
    return g.backend.all_gather(list(tensor_list), tensor, async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """The ranks' input tensors concatenated along dim 0 (or stacked: output shaped
    (world, *input.shape)) into `output_tensor`."""
    _check_group(group)
    g = _need("all_gather_into_tensor")
    _tensor(input_tensor, "all_gather_into_tensor")
    if _tensor(output_tensor, "all_gather_into_tensor").numel() != \
            g.size * input_tensor.numel():
        raise DistributedError(f"all_gather_into_tensor: output of shape "
                               f"{tuple(output_tensor.shape)} must hold world size ({g.size}) "
                               f"x input {tuple(input_tensor.shape)}")
    _agree(g, "all_gather_into_tensor", input_tensor)
    return g.backend.all_gather_into_tensor(output_tensor, input_tensor, async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce `input` (world size x output's size, along dim 0) over the ranks with `op`;
    rank i's `output` gets block i of the result."""
    _check_group(group)
    g = _need("reduce_scatter_tensor")
    _tensor(input, "reduce_scatter_tensor")
    if _tensor(output, "reduce_scatter_tensor").numel() * g.size != input.numel():
        raise DistributedError(f"reduce_scatter_tensor: input of shape {tuple(input.shape)} "
                               f"must be world size ({g.size}) x output "
                               f"{tuple(output.shape)}")
    if output.dtype is not input.dtype:
        raise DistributedError("reduce_scatter_tensor: input and output dtypes differ "
                               f"({input.dtype.name}, {output.dtype.name})")
    _agree(g, "reduce_scatter_tensor", input, _reduce_op(op))
    return g.backend.reduce_scatter_tensor(output, input, op, async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce input_list[i] over the ranks with `op` into rank i's `output`."""
    _check_group(group)
    g = _need("reduce_scatter")
    if len(input_list) != g.size:
        raise DistributedError(f"reduce_scatter: input_list has {len(input_list)} tensors, "
                               f"the world {g.size} ranks")
    for t in input_list:
        if tuple(_tensor(t, "reduce_scatter").shape) != tuple(output.shape) or \
                t.dtype is not output.dtype:
            raise DistributedError(f"reduce_scatter: an input {t.dtype.name} "
                                   f"{tuple(t.shape)} for an output {output.dtype.name} "
                                   f"{tuple(output.shape)}")
    from ..tensor import stack
    flat = stack(list(input_list))
    _agree(g, "reduce_scatter", flat, _reduce_op(op))
    return g.backend.reduce_scatter_tensor(output, flat, op, async_op)


def _p2p_meta(g, t):
    return _describe("send/recv", t) if _checks[0] else None


def send(tensor, dst, group=None, tag=0):
    """Send `tensor` to rank `dst` (blocks until the data is handed over)."""
    return _send(tensor, dst, group, tag, False)


def isend(tensor, dst, group=None, tag=0):
    """send that returns a work handle at once."""
    return _send(tensor, dst, group, tag, True)


def _send(tensor, dst, group, tag, async_op):
    _check_group(group)
    g = _need("send")
    _tensor(tensor, "send")
    if not 0 <= dst < g.size or dst == g.rank:
        raise DistributedError(f"send: invalid destination rank {dst} (this is rank "
                               f"{g.rank} of {g.size})")
    return g.backend.send(tensor, dst, tag, _p2p_meta(g, tensor), async_op)


def recv(tensor, src=None, group=None, tag=0):
    """Receive into `tensor` from rank `src` (any rank when None); returns the sender's
    rank."""
    return _recv(tensor, src, group, tag, False)[1]


def irecv(tensor, src=None, group=None, tag=0):
    """recv that returns a work handle at once (wait() before reading tensor)."""
    return _recv(tensor, src, group, tag, True)[0]


def _recv(tensor, src, group, tag, async_op):
    _check_group(group)
    g = _need("recv")
    _tensor(tensor, "recv")
    if src is not None and (not 0 <= src < g.size or src == g.rank):
        raise DistributedError(f"recv: invalid source rank {src} (this is rank "
                               f"{g.rank} of {g.size})")
    mine = _p2p_meta(g, tensor)

    def check(theirs, source):
        if not (theirs == mine).all():
            raise DistributedError(f"zyx.distributed.recv: rank {source} sent "
                                   f"{_text(theirs)}, rank {g.rank} expects {_text(mine)}")
    return g.backend.recv(tensor, src, tag, mine, check, async_op)


