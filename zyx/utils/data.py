"""Datasets and batching with torch.utils.data's names and semantics.

    ds = TensorDataset(x_numpy, y_numpy)
    for x, y in DataLoader(ds, batch_size=32, shuffle=True, drop_last=True):
        loss = F.cross_entropy(model(x), y)          # x, y are zyx tensors

Samples are numpy arrays, zyx tensors or Python numbers; batches are zyx tensors. Each
field of a batch becomes one contiguous numpy array handed to `zyx.from_numpy` (no copy on
the C backend), so a batch costs one host gather per field and no tensor per sample. A
`TensorDataset` (or a `Subset` of one) is gathered with one fancy index per field.

Where zyx differs from torch:
- `num_workers > 0` loads map-style datasets in worker processes (zyx/utils/workers.py
  says how: torch's seeding, worker_init_fn, errors and dead workers); workers send
  host arrays and the main process makes the tensors. An IterableDataset still loads in
  the calling process (a warning says so).
- `generator=` takes a `numpy.random.Generator` or an int seed. Without one, each epoch's
  order is drawn from zyx's global generator, so `zyx.manual_seed(s)` fixes every order.
- Python floats collate to float64 and ints to int64, as torch's default_collate.
"""
from __future__ import annotations

import bisect
import itertools
import math
import numbers
import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from . import workers
from .workers import get_worker_info

__all__ = ["Dataset", "IterableDataset", "TensorDataset", "Subset", "ConcatDataset",
           "DataLoader", "Sampler", "SequentialSampler", "RandomSampler", "BatchSampler",
           "SubsetRandomSampler", "random_split", "default_collate", "default_convert",
           "get_worker_info", "DistributedSampler"]


def _zyx():
    import zyx
    return zyx


def _is_tensor(x) -> bool:
    return isinstance(x, _zyx().Tensor)


def _host_array(x) -> np.ndarray:
    """A numpy view of a sample field (zyx tensors are read once: realized then copied)."""
    if _is_tensor(x):
        return x.numpy()
    return np.asarray(x)


def _rng_of(generator) -> np.random.Generator:
    """The numpy generator that draws one epoch's order."""
    if generator is None:
        from ..runtime import RT
        # a fresh seed from zyx's global generator per epoch (torch draws from its default
        # generator the same way): zyx.manual_seed fixes the orders, epochs still differ
        return np.random.Generator(np.random.PCG64(int(RT.rng.integers(0, 2 ** 63))))
    if isinstance(generator, np.random.Generator):
        return generator
    if isinstance(generator, numbers.Integral) and not isinstance(generator, bool):
        return np.random.Generator(np.random.PCG64(int(generator)))
    raise TypeError(f"generator must be a numpy.random.Generator, an int seed or None, got "
                    f"{type(generator).__name__}")


def _seeded(generator):
    """A generator object to keep for several epochs (an int seed becomes one generator,
    so successive epochs differ, as with a torch.Generator)."""
    if generator is None or isinstance(generator, np.random.Generator):
        return generator
    return _rng_of(generator)      # an int seed, or a TypeError for anything else


# ---------------------------------------------------------------------------------------------
# datasets
# ---------------------------------------------------------------------------------------------
class Dataset:
    """Map-style dataset: subclass it and define `__getitem__(index)` and `__len__()`.
    `a + b` concatenates two datasets (ConcatDataset)."""

    def __getitem__(self, index):
        raise NotImplementedError(f"{type(self).__name__} must define __getitem__")

    def __add__(self, other):
        return ConcatDataset([self, other])

    def _gather_arrays(self, indices):
        """Each field of the samples at `indices` as one stacked numpy array, or None when
        this dataset has no faster way than fetching the samples one by one."""
        return None


class IterableDataset(Dataset):
    """Stream-style dataset: define `__iter__`; the DataLoader batches what it yields
    (no shuffling or sampler: the stream decides the order)."""

    def __iter__(self):
        raise NotImplementedError(f"{type(self).__name__} must define __iter__")


class TensorDataset(Dataset):
    """Samples are the index-th rows of the given tensors (zyx tensors or numpy arrays, all
    with the same first dimension). `ds[i]` returns a tuple of those rows; batches from a
    DataLoader are gathered from the host arrays with one fancy index per field."""

    def __init__(self, *tensors):
        if not tensors:
            raise ValueError("TensorDataset needs at least one tensor")
        sizes = [t.shape[0] if len(t.shape) else None for t in tensors]
        if None in sizes or any(s != sizes[0] for s in sizes):
            raise ValueError(f"Size mismatch between tensors: first dimensions {sizes}")
        self.tensors = tuple(tensors)
        self._arrays = None

    def __getitem__(self, index):
        return tuple(t[index] for t in self.tensors)

    def __len__(self):
        return self.tensors[0].shape[0]

    def _gather_arrays(self, indices):
        if self._arrays is None:       # zyx tensors are read to the host once
            self._arrays = [_host_array(t) for t in self.tensors]
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and idx[-1] - idx[0] == idx.size - 1 and np.all(np.diff(idx) == 1):
            # a run of consecutive rows (shuffle=False) is a view, not a copy
            return [a[idx[0]:idx[-1] + 1] for a in self._arrays]
        return [a[idx] for a in self._arrays]


class Subset(Dataset):
    """The samples of `dataset` at `indices`, in that order."""

    def __init__(self, dataset, indices):
        self.dataset = dataset
        self.indices = indices

    def __getitem__(self, idx):
        if isinstance(idx, list):
            return self.dataset[[self.indices[i] for i in idx]]
        return self.dataset[self.indices[idx]]

    def __len__(self):
        return len(self.indices)

    def _gather_arrays(self, indices):
        return self.dataset._gather_arrays([self.indices[i] for i in indices]) \
            if isinstance(self.dataset, Dataset) else None


class ConcatDataset(Dataset):
    """The samples of several datasets one after the other."""

    def __init__(self, datasets):
        self.datasets = list(datasets)
        if not self.datasets:
            raise ValueError("datasets should not be an empty iterable")
        for d in self.datasets:
            if isinstance(d, IterableDataset):
                raise TypeError("ConcatDataset does not support IterableDataset")
        self.cumulative_sizes = list(itertools.accumulate(len(d) for d in self.datasets))

    def __len__(self):
        return self.cumulative_sizes[-1]

    def __getitem__(self, idx):
        if idx < 0:
            if -idx > len(self):
                raise ValueError("absolute value of index should not exceed dataset length")
            idx += len(self)
        k = bisect.bisect_right(self.cumulative_sizes, idx)
        start = self.cumulative_sizes[k - 1] if k else 0
        return self.datasets[k][idx - start]


def random_split(dataset, lengths, generator=None):
    """Split `dataset` into non-overlapping Subsets of the given lengths (ints summing to
    len(dataset), or fractions summing to 1: floors, the remainder handed out one by one
    from the first subset on, as torch)."""
    n = len(dataset)
    lengths = list(lengths)
    if lengths and math.isclose(sum(lengths), 1) and sum(lengths) <= 1:
        counts = []
        for i, frac in enumerate(lengths):
            if frac < 0 or frac > 1:
                raise ValueError(f"Fraction at index {i} is not between 0 and 1")
            counts.append(int(math.floor(n * frac)))
        for i in range(n - sum(counts)):
            counts[i % len(counts)] += 1
        lengths = counts
    if sum(lengths) != n:
        raise ValueError("Sum of input lengths does not equal the length of the input dataset!")
    order = _rng_of(generator).permutation(n).tolist()
    out, start = [], 0
    for k in lengths:
        out.append(Subset(dataset, order[start:start + k]))
        start += k
    return out


# ---------------------------------------------------------------------------------------------
# samplers
# ---------------------------------------------------------------------------------------------
class Sampler:
    """Yields dataset indices; subclasses define `__iter__` (and `__len__`)."""

    def __init__(self, data_source=None):
        self.data_source = data_source

    def __iter__(self):
        raise NotImplementedError(f"{type(self).__name__} must define __iter__")


class SequentialSampler(Sampler):
    """0, 1, ..., len(data_source) - 1."""

    def __iter__(self):
        return iter(range(len(self.data_source)))

    def __len__(self):
        return len(self.data_source)


class RandomSampler(Sampler):
    """A random permutation per epoch (or `num_samples` draws with replacement)."""

    def __init__(self, data_source, replacement=False, num_samples=None, generator=None):
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = _seeded(generator)
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement should be a boolean value, but got "
                            f"replacement={replacement}")
        if not isinstance(self.num_samples, int) or self.num_samples <= 0:
            raise ValueError(f"num_samples should be a positive integer value, but got "
                             f"num_samples={self.num_samples}")

    @property
    def num_samples(self):
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __iter__(self):
        rng, n = _rng_of(self.generator), len(self.data_source)
        if self.replacement:
            return iter(rng.integers(0, n, size=self.num_samples).tolist())
        reps = -(-self.num_samples // n)
        order = np.concatenate([rng.permutation(n) for _ in range(reps)])
        return iter(order[:self.num_samples].tolist())

    def __len__(self):
        return self.num_samples


class SubsetRandomSampler(Sampler):
    """The given indices in a random order per epoch."""

    def __init__(self, indices, generator=None):
        self.indices = list(indices)
        self.generator = _seeded(generator)

    def __iter__(self):
        perm = _rng_of(self.generator).permutation(len(self.indices))
        return iter([self.indices[i] for i in perm])

    def __len__(self):
        return len(self.indices)


class BatchSampler(Sampler):
    """Groups the indices of `sampler` into lists of `batch_size` (the last one shorter
    unless drop_last)."""

    def __init__(self, sampler, batch_size, drop_last):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"batch_size should be a positive integer value, but got "
                             f"batch_size={batch_size}")
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last should be a boolean value, but got drop_last={drop_last}")
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __iter__(self):
        it = iter(self.sampler)
        while True:
            batch = list(itertools.islice(it, self.batch_size))
            if not batch or (self.drop_last and len(batch) < self.batch_size):
                return
            yield batch

    def __len__(self):
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


# ---------------------------------------------------------------------------------------------
# collation
# ---------------------------------------------------------------------------------------------
def _to_tensor(arr: np.ndarray):
    """One batch array as a zyx tensor sharing its memory where the device allows."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return _zyx().from_numpy(arr)


def _stack_field(samples, make):
    """Samples of one field (arrays, tensors or numbers) -> one stacked array, made into
    what `make` makes of it (a zyx tensor; in a worker, a workers.Host)."""
    first = samples[0]
    if isinstance(first, bool):
        return make(np.array(samples, dtype=np.bool_))
    if isinstance(first, numbers.Integral) and not isinstance(first, np.generic):
        return make(np.array(samples, dtype=np.int64))
    if isinstance(first, numbers.Real) and not isinstance(first, np.generic):
        return make(np.array(samples, dtype=np.float64))
    arrays = [_host_array(s) for s in samples]
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise RuntimeError(f"stack expects each tensor to be equal size, but got shapes "
                           f"{sorted(shapes)} in one batch")
    return make(np.stack(arrays))


def _collate(batch, make):
    """default_collate with `make` turning each stacked array into the batch's leaf."""
    first = batch[0]
    if _is_tensor(first) or isinstance(first, (np.ndarray, np.generic, numbers.Number)):
        return _stack_field(batch, make)
    if isinstance(first, (str, bytes)):
        return list(batch)
    if isinstance(first, Mapping):
        fields = {k: _collate([s[k] for s in batch], make) for k in first}
        try:
            return type(first)(fields)
        except TypeError:
            return fields
    if isinstance(first, tuple) and hasattr(first, "_fields"):       # namedtuple
        return type(first)(*(_collate(list(f), make) for f in zip(*batch)))
    if isinstance(first, Sequence):
        if any(len(s) != len(first) for s in batch):
            raise RuntimeError("each element in list of batch should be of equal size")
        return [_collate(list(f), make) for f in zip(*batch)]
    raise TypeError(f"default_collate: batch must contain tensors, numpy arrays, numbers, "
                    f"dicts or lists; found {type(first).__name__}")


def default_collate(batch):
    """Turn a list of samples into a batch, as torch's default_collate: arrays, tensors
    and numbers are stacked into a zyx tensor with a new first dimension; dicts, tuples
    and lists are collated field by field (tuples and lists come back as lists, namedtuples
    as namedtuples); strings stay a list."""
    return _collate(batch, _to_tensor)


def _walk(data, leaf, sequence=None):
    """`data` with `leaf(x)` in place of every x `leaf` takes (it returns NotImplemented
    for the others), through mappings, namedtuples, lists and tuples; `sequence` makes the
    lists and tuples (None: their own type)."""
    out = leaf(data)
    if out is not NotImplemented:
        return out
    if isinstance(data, Mapping):
        return type(data)({k: _walk(v, leaf, sequence) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_walk(v, leaf, sequence) for v in data))
    if isinstance(data, (list, tuple)):
        return (sequence or type(data))(_walk(v, leaf, sequence) for v in data)
    return data


def _convert(data, make):
    """default_convert with `make` turning each array into the leaf."""
    def leaf(x):
        if _is_tensor(x):
            return x
        if isinstance(x, (np.ndarray, np.generic)):
            return make(np.asarray(x))
        return NotImplemented
    return _walk(data, leaf, list)


def default_convert(data):
    """What batch_size=None yields: numpy arrays and numbers become zyx tensors, containers
    are converted element by element."""
    return _convert(data, _to_tensor)


# -- what worker processes run (workers.run pickles these by name) --------------------------
def _to_host(data):
    """A batch made in a worker, its zyx tensors as host arrays (workers.Host)."""
    return _walk(data, lambda x: workers.Host(x.numpy()) if _is_tensor(x) else NotImplemented)


def _from_host(data):
    """A batch a worker sent, its workers.Host arrays made zyx tensors."""
    return _walk(data, lambda x: _to_tensor(x.array) if isinstance(x, workers.Host)
                 else NotImplemented)


def _worker_batch(job, arg):
    """One task in a worker: the batch of `arg` (its indices, or one index where the
    loader does not batch) with host arrays. `job`: (dataset, collate_fn or None for the
    default, whether the loader batches), given to the worker once when it starts."""
    dataset, collate_fn, batched = job
    if not batched:
        sample = dataset[arg]
        return _to_host(collate_fn(sample)) if collate_fn else _convert(sample, workers.Host)
    if collate_fn is None and isinstance(dataset, Dataset):
        arrays = dataset._gather_arrays(arg)
        if arrays is not None:
            return [workers.Host(a) for a in arrays]
    if hasattr(dataset, "__getitems__"):
        samples = dataset.__getitems__(arg)
    else:
        samples = [dataset[i] for i in arg]
    return _to_host(collate_fn(samples)) if collate_fn else _collate(samples, workers.Host)


def _start_worker(seed):
    """A worker's start: zyx's generator seeded as torch seeds its own, and zyx work in
    the worker (a collate_fn's tensors) kept on the CPU: a GPU context does not survive
    fork (torch's workers make CPU tensors too)."""
    zyx = _zyx()
    zyx.manual_seed(seed)
    zyx.set_default_device("cpu")


# ---------------------------------------------------------------------------------------------
# the loader
# ---------------------------------------------------------------------------------------------
class DataLoader:
    """Iterate over `dataset` in batches (torch.utils.data.DataLoader's arguments).

    shuffle=True draws a new permutation every epoch (from `generator`, else from zyx's
    global generator); drop_last drops a last incomplete batch; `sampler` /
    `batch_sampler` replace the default order; `collate_fn` replaces default_collate."""

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device=""):
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError("num_workers option should be non-negative; use num_workers=0 to "
                             "disable multiprocessing.")
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if num_workers > 0 and isinstance(dataset, IterableDataset):
            warnings.warn("zyx DataLoader loads an IterableDataset in the main process: "
                          f"num_workers={num_workers} is ignored", stacklevel=2)
        if prefetch_factor is not None and (num_workers == 0 or prefetch_factor < 1):
            raise ValueError("prefetch_factor option could only be specified in "
                             "multiprocessing. let num_workers > 0 to enable multiprocessing, "
                             "otherwise set prefetch_factor to None.")
        self.dataset = dataset
        self.num_workers = num_workers
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.prefetch_factor = prefetch_factor if prefetch_factor is not None else 2
        self.generator = _seeded(generator)
        self._iterable = isinstance(dataset, IterableDataset)
        if self._iterable and (shuffle or sampler is not None or batch_sampler is not None):
            raise ValueError("DataLoader with IterableDataset: expected unspecified shuffle, "
                             "sampler and batch_sampler options")
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("batch_sampler option is mutually exclusive with batch_size, "
                                 "shuffle, sampler, and drop_last")
            batch_size, drop_last = None, False
        elif batch_size is None and drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually "
                             "exclusive with drop_last")
        if sampler is None and not self._iterable:
            sampler = RandomSampler(dataset, generator=self.generator) if shuffle else \
                SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None and not self._iterable:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        self.batch_size, self.drop_last = batch_size, drop_last
        self.sampler, self.batch_sampler = sampler, batch_sampler
        self._custom_collate = collate_fn is not None
        self.collate_fn = collate_fn if collate_fn is not None else (
            default_collate if batch_size is not None or batch_sampler is not None
            else default_convert)

    def __len__(self):
        if self._iterable:
            n = len(self.dataset)
            if self.batch_size is None:
                return n
            return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        return len(self.sampler)

    def __iter__(self):
        if self._iterable:
            return self._iter_stream()
        if self.num_workers > 0:
            return self._iter_workers()
        if self.batch_sampler is None:
            return (self.collate_fn(self.dataset[i]) for i in self.sampler)
        return (self._fetch(indices) for indices in self.batch_sampler)

    def _fetch(self, indices):
        """One batch: stacked host arrays straight to tensors when the dataset can gather
        them (TensorDataset, Subset of one), else the samples collated."""
        if not self._custom_collate and isinstance(self.dataset, Dataset):
            arrays = self.dataset._gather_arrays(indices)
            if arrays is not None:
                return [_to_tensor(a) for a in arrays]
        if hasattr(self.dataset, "__getitems__"):
            samples = self.dataset.__getitems__(indices)
        else:
            samples = [self.dataset[i] for i in indices]
        return self.collate_fn(samples)

    def _iter_workers(self):
        """Batches loaded by worker processes (workers.run), in order."""
        batched = self.batch_sampler is not None
        job = (self.dataset, self.collate_fn if self._custom_collate else None, batched)
        tasks = (list(ix) if batched else ix
                 for ix in (self.batch_sampler if batched else self.sampler))
        base_seed = int(_rng_of(self.generator).integers(0, 2 ** 62))
        return workers.run(_worker_batch, job, tasks, self.num_workers, _from_host,
                           seed=base_seed, seed_fn=_start_worker, init_fn=self.worker_init_fn,
                           prefetch_factor=self.prefetch_factor, timeout=self.timeout,
                           context=self.multiprocessing_context)

    def _iter_stream(self):
        it = iter(self.dataset)
        if self.batch_size is None:
            for sample in it:
                yield self.collate_fn(sample)
            return
        while True:
            batch = list(itertools.islice(it, self.batch_size))
            if not batch or (self.drop_last and len(batch) < self.batch_size):
                return
            yield self.collate_fn(batch)


class DistributedSampler(Sampler):
    """torch.utils.data.distributed.DistributedSampler: this rank's share of the dataset.

    Every rank sees a disjoint `len(dataset) / num_replicas` of the indices (rank r takes
    every num_replicas-th index from position r). When the dataset does not divide evenly,
    the index list is padded with its own first indices (each rank then has
    ceil(len / num_replicas), a few samples twice per epoch), or with drop_last=True cut to
    the largest multiple. With shuffle=True the order is a permutation seeded by
    `seed + epoch`, the same on every rank: call `set_epoch(epoch)` at the start of each
    epoch, or every epoch repeats the first one's order. num_replicas and rank default to
    the process group's (zyx.distributed). The permutation is numpy's, not torch's: the
    same (seed, epoch) gives a different but equally fixed order than in torch."""

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=False):
        if num_replicas is None or rank is None:
            from .. import distributed as dist
            if not dist.is_initialized():
                raise RuntimeError("DistributedSampler needs num_replicas and rank, or an "
                                   "initialized process group (zyx.distributed."
                                   "init_process_group)")
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"num_replicas should be at least 1, got {num_replicas}")
        if rank >= num_replicas or rank < 0:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.epoch = 0
        self.drop_last = bool(drop_last)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        n = len(dataset)
        if self.drop_last and n % self.num_replicas:
            self.num_samples = math.ceil((n - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        n = len(self.dataset)
        if self.shuffle:
            order = np.random.default_rng(self.seed + self.epoch).permutation(n)
        else:
            order = np.arange(n)
        if self.drop_last:
            order = order[:self.total_size]
        elif self.total_size > n:
            reps = -(-self.total_size // max(n, 1))
            order = np.tile(order, reps)[:self.total_size]
        return iter(order[self.rank:self.total_size:self.num_replicas].tolist())

    def __len__(self):
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose permutation the next iteration uses (shuffle=True)."""
        self.epoch = int(epoch)
