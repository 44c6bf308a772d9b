"""DistributedDataParallel: one model replica per process, gradients averaged over the
processes after each backward(), so every replica takes the same optimizer step.

How it meets zyx's lazy autograd: `backward()` only records the gradients (they are
computed by the next realization). DDP registers a post-accumulate-grad hook on every
parameter; at the end of a backward() the first hook that fires flattens the fresh `.grad`s
into buckets (about `bucket_cap_mb` each, in reverse parameter order, the order backward
produces them) and computes them all in one plan (forward, backward and the flattening
fuse there; computing bucket by bucket would recompute the forward for each), starting
each bucket's all-reduce as soon as the plan has queued the kernel computing it
(`all_reduce_as_computed`): with NCCL, on a stream of its own, so the first buckets'
transfers overlap the kernels of the rest of the backward; with MPI, once the plan ran.
The buckets' shapes are checked across the ranks once, at the first reduction. Each
parameter's `.grad` then is a lazy slice of its reduced bucket times 1/world_size, which
fuses into the optimizer's update:
`loss.backward(); opt.step()` with any zyx optimizer works unchanged, and `.grad` read
after backward() is already the average (as in torch, so clip_grad_norm_ sees it too)."""
from __future__ import annotations

import contextlib
import weakref

from ... import distributed as dist
from ...autograd import no_grad
from ...runtime import RT
from ...tensor import cat, zeros
from ..modules.module import Module

_FIRST_BUCKET_BYTES = 1 << 20     # torch's first bucket: small, so its reduce starts early


class _Bucket:
    """Parameters of one dtype whose gradients are reduced as one flat tensor."""

    __slots__ = ("params", "dtype", "sizes")

    def __init__(self, dtype):
        self.params = []
        self.dtype = dtype
        self.sizes = []


class DistributedDataParallel(Module):
    """torch.nn.parallel.DistributedDataParallel over the default process group.

    Wrapping broadcasts rank 0's parameters and buffers to every rank. Each forward runs
    `module` (and, with broadcast_buffers, first broadcasts rank 0's buffers, e.g.
    BatchNorm statistics); the following backward() averages the gradients over the ranks
    (see the module docstring). Inside `with ddp.no_sync():` forwards skip that, so
    gradients accumulate locally; the first backward of a forward outside it averages the
    accumulated sum. `module` is the wrapped model (save `ddp.module.state_dict()` on rank
    0 for a checkpoint without the "module." prefix).

    A parameter with no gradient on this rank (unused in this forward) contributes zeros
    and receives the average of the others' gradients, as torch with
    find_unused_parameters=True; device_ids, output_device, dim, gradient_as_bucket_view
    and static_graph are accepted for compatibility and have no effect (zyx places the
    computation where the tensors are)."""

    def __init__(self, module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=True, process_group=None, bucket_cap_mb=25,
                 find_unused_parameters=False, gradient_as_bucket_view=False,
                 static_graph=False):
        super().__init__()
        if not dist.is_initialized():
            raise dist.DistributedError(
                "DistributedDataParallel needs the default process group: call "
                "zyx.distributed.init_process_group first")
        if process_group is not None:
            raise dist.DistributedError("DistributedDataParallel supports only the default "
                                        "process group")
        self.module = module
        self.broadcast_buffers = bool(broadcast_buffers)
        self.require_backward_grad_sync = True
        self.bucket_cap_mb = bucket_cap_mb
        # False: start the reductions once the whole backward was computed (for measuring
        # what the overlap buys; nothing else changes)
        self.overlap_reduction = True
        self._checked = False              # the buckets' cross-rank check passed
        self._sync_next = True
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._reduced = {}                 # id(param) -> weakref to the .grad DDP set
        with no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, 0)
        self._buckets = self._make_buckets(int(bucket_cap_mb * (1 << 20)))
        me = weakref.ref(self)

        def hook(p):
            ddp = me()
            if ddp is not None:
                ddp._grad_ready(p)
        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in self._params]

    def _make_buckets(self, cap):
        buckets, open_by_dtype = [], {}
        for p in reversed(self._params):
            b = open_by_dtype.get(p.dtype)
            nbytes = p.numel() * p.dtype.itemsize
            limit = min(_FIRST_BUCKET_BYTES, cap) if len(buckets) <= 1 else cap
            if b is None or (b.params and sum(b.sizes) * p.dtype.itemsize + nbytes > limit):
                b = open_by_dtype[p.dtype] = _Bucket(p.dtype)
                buckets.append(b)
            b.params.append(p)
            b.sizes.append(p.numel())
        return buckets

    @property
    def bucket_sizes(self):
        """The buckets' sizes in bytes, in the order their reductions start."""
        return [sum(b.sizes) * b.dtype.itemsize for b in self._buckets]

    def forward(self, *args, **kwargs):
        """Run the wrapped module; the next backward() averages gradients unless this
        forward ran inside no_sync()."""
        self._sync_next = self.require_backward_grad_sync
        if self.broadcast_buffers and self._sync_next:
            with no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b, 0)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Forwards (and their backwards) inside skip the gradient average: gradients
        accumulate locally until a backward outside averages their sum."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # -- the reduction ------------------------------------------------------------------------
    def _grad_ready(self, p):
        if not self._sync_next:
            return
        ref = self._reduced.get(id(p))
        if ref is not None and ref() is p.grad:
            return                       # this backward's reduction already ran
        self.reduce_gradients()

    def reduce_gradients(self):
        """Average every parameter's `.grad` over the ranks now (backward() calls it;
        call it yourself after gradients set by other means, on every rank)."""
        flats = []
        with no_grad():
            for b in self._buckets:
                parts = []
                for p, n in zip(b.params, b.sizes):
                    g = p.grad
                    parts.append(zeros(n, dtype=b.dtype, device=p.device) if g is None
                                 else g.detach().reshape(n).cast(b.dtype))
                    p.grad = None       # only the flat buckets are computed, not both
                flats.append(cat(parts) if len(parts) > 1 else parts[0])
                del parts
            # one plan computes everything backward() left lazy, and the buckets; each
            # bucket's reduction starts once it is computed (in place: each flat bucket
            # is a fresh buffer only it holds). The buckets never change, so their
            # cross-rank check runs once.
            if not self.overlap_reduction:
                RT.realize([f._id for f in flats])
            dist.all_reduce_as_computed(flats, check=not self._checked).wait()
            self._checked = True
            scale = 1.0 / dist.get_world_size()
            for b, f in zip(self._buckets, flats):
                off = 0
                for p, n in zip(b.params, b.sizes):
                    g = f[off:off + n].reshape(p.shape) * scale
                    if g.dtype is not p.dtype:
                        g = g.cast(p.dtype)
                    p.grad = g
                    self._reduced[id(p)] = weakref.ref(g)
                    off += n
