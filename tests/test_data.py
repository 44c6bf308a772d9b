"""zyx.utils.data against torch.utils.data: batch shapes and dtypes, order, shuffling,
drop_last, dict/tuple collation, random_split, Subset, samplers."""
from __future__ import annotations

import os
import time
from collections import namedtuple

import numpy as np
import pytest

import zyx
from zyx.utils.data import (BatchSampler, ConcatDataset, DataLoader, Dataset, IterableDataset,
                            RandomSampler, Subset, TensorDataset, default_collate, random_split)

try:
    import torch
    import torch.utils.data as tud
except ImportError:
    torch = tud = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


def _arrays(n=10):
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    y = np.arange(n, dtype=np.int64) % 4
    return x, y


class DictData(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": np.full((2,), i, np.float32), "y": i, "w": float(i) / 2, "name": f"s{i}"}


@needs_torch
@pytest.mark.parametrize("batch_size,drop_last", [(3, False), (3, True), (5, False), (1, True),
                                                  (20, False)])
def test_batches_match_torch_in_order(batch_size, drop_last):
    x, y = _arrays(10)
    ours = list(DataLoader(TensorDataset(x, y), batch_size=batch_size, drop_last=drop_last))
    ref = list(tud.DataLoader(tud.TensorDataset(torch.tensor(x), torch.tensor(y)),
                              batch_size=batch_size, drop_last=drop_last))
    assert len(ours) == len(ref) == len(DataLoader(TensorDataset(x, y), batch_size=batch_size,
                                                   drop_last=drop_last))
    for (bx, by), (rx, ry) in zip(ours, ref):
        assert isinstance(bx, zyx.Tensor) and bx.shape == tuple(rx.shape)
        assert bx.dtype == zyx.float32 and by.dtype == zyx.int64
        np.testing.assert_array_equal(bx.numpy(), rx.numpy())
        np.testing.assert_array_equal(by.numpy(), ry.numpy())


def test_shuffle_visits_every_sample_once_per_epoch_and_epochs_differ():
    x, y = _arrays(23)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=7)
    epochs = []
    for _ in range(2):
        seen = np.concatenate([by.numpy() * 0 + bx.numpy()[:, 0].astype(np.int64) // 3
                               for bx, by in loader])
        assert sorted(seen.tolist()) == list(range(23))
        epochs.append(seen.tolist())
    assert epochs[0] != epochs[1]


def test_shuffle_is_reproducible_with_a_generator_or_manual_seed():
    x, _ = _arrays(16)
    ds = TensorDataset(x)

    def order(**kw):
        return np.concatenate([b[0].numpy()[:, 0] for b in DataLoader(ds, 4, shuffle=True, **kw)])

    np.testing.assert_array_equal(order(generator=np.random.default_rng(3)),
                                  order(generator=np.random.default_rng(3)))
    zyx.manual_seed(11)
    a = order()
    zyx.manual_seed(11)
    np.testing.assert_array_equal(a, order())
    assert not np.array_equal(a, np.sort(a))          # shuffled at all


@needs_torch
def test_dict_collation_matches_torch():
    ours = next(iter(DataLoader(DictData(5), batch_size=3)))
    ref = next(iter(tud.DataLoader(DictData(5), batch_size=3)))
    assert set(ours) == set(ref)
    for k in ("x", "y", "w"):
        assert ours[k].shape == tuple(ref[k].shape)
        assert ours[k].dtype.name == str(ref[k].dtype).replace("torch.", "")
        np.testing.assert_array_equal(ours[k].numpy(), ref[k].numpy())
    assert ours["name"] == ref["name"] == ["s0", "s1", "s2"]


def test_tuple_list_namedtuple_and_tensor_samples_collate():
    P = namedtuple("P", "a b")
    batch = default_collate([P(zyx.tensor([1.0, 2.0]), 3), P(zyx.tensor([4.0, 5.0]), 6)])
    assert isinstance(batch, P)
    np.testing.assert_array_equal(batch.a.numpy(), [[1, 2], [4, 5]])
    np.testing.assert_array_equal(batch.b.numpy(), [3, 6])
    out = default_collate([(np.ones(2, np.float32), [1, 2]), (np.zeros(2, np.float32), [3, 4])])
    assert isinstance(out, list) and out[0].shape == (2, 2)
    assert [t.numpy().tolist() for t in out[1]] == [[1, 3], [2, 4]]
    with pytest.raises(RuntimeError, match="equal size"):
        default_collate([[1, 2], [3]])
    with pytest.raises(RuntimeError, match="equal size"):
        default_collate([np.zeros(2), np.zeros(3)])


def test_tensor_dataset_of_zyx_tensors_and_indexing():
    x, y = _arrays(6)
    ds = TensorDataset(zyx.tensor(x), zyx.tensor(y))
    assert len(ds) == 6
    xi, yi = ds[2]
    np.testing.assert_array_equal(xi.numpy(), x[2])
    (bx, by), = list(DataLoader(ds, batch_size=6))
    np.testing.assert_array_equal(bx.numpy(), x)
    with pytest.raises(ValueError, match="Size mismatch"):
        TensorDataset(x, y[:5])


def test_tensor_dataset_batches_do_not_fetch_samples_one_by_one():
    x, y = _arrays(8)

    class Counting(TensorDataset):
        calls = 0

        def __getitem__(self, i):
            Counting.calls += 1
            return super().__getitem__(i)

    for _ in DataLoader(Counting(x, y), batch_size=4, shuffle=True):
        pass
    assert Counting.calls == 0


@needs_torch
def test_random_split_lengths_and_fractions_like_torch():
    ds = TensorDataset(*_arrays(10))
    parts = random_split(ds, [0.3, 0.3, 0.4], generator=0)
    ref = tud.random_split(range(10), [0.3, 0.3, 0.4])
    assert [len(p) for p in parts] == [len(r) for r in ref]
    parts = random_split(range(11), [0.5, 0.5], generator=1)
    ref = tud.random_split(range(11), [0.5, 0.5])
    assert [len(p) for p in parts] == [len(r) for r in ref]
    idx = sorted(i for p in parts for i in p)
    assert idx == list(range(11))
    with pytest.raises(ValueError, match="Sum of input lengths"):
        random_split(ds, [3, 3])


def test_subset_and_concat_and_batch_sampler():
    x, y = _arrays(10)
    sub = Subset(TensorDataset(x, y), [9, 0, 4])
    (bx, by), = list(DataLoader(sub, batch_size=3))
    np.testing.assert_array_equal(by.numpy(), y[[9, 0, 4]])
    cat = ConcatDataset([sub, TensorDataset(x[:2], y[:2])])
    assert len(cat) == 5 and int(cat[3][1].item() if hasattr(cat[3][1], "item") else cat[3][1]) == y[0]
    bs = list(BatchSampler(range(7), 3, drop_last=False))
    assert bs == [[0, 1, 2], [3, 4, 5], [6]]
    assert len(BatchSampler(range(7), 3, drop_last=True)) == 2
    assert sorted(RandomSampler(range(9), generator=2)) == list(range(9))
    loader = DataLoader(TensorDataset(x), batch_sampler=[[1, 2], [5]])
    assert [b[0].shape[0] for b in loader] == [2, 1]


def test_iterable_dataset_and_no_batching():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(np.arange(7, dtype=np.float32))

    assert [b.shape for b in DataLoader(Stream(), batch_size=3)] == [(3,), (3,), (1,)]
    assert len(list(DataLoader(Stream(), batch_size=3, drop_last=True))) == 2
    with pytest.raises(ValueError):
        DataLoader(Stream(), shuffle=True)
    items = list(DataLoader(TensorDataset(np.arange(3.0)), batch_size=None))
    assert len(items) == 3


def test_bad_arguments_raise_like_torch():
    ds = TensorDataset(*_arrays(4))
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(ds, batch_size=0)
    with pytest.raises(ValueError, match="mutually exclusive"):
        DataLoader(ds, sampler=range(4), shuffle=True)
    with pytest.raises(ValueError, match="num_workers"):
        DataLoader(ds, num_workers=-1)
    with pytest.raises(TypeError, match="generator"):
        DataLoader(ds, shuffle=True, generator="seed")
    with pytest.raises(ValueError, match="prefetch_factor"):
        DataLoader(ds, prefetch_factor=2)            # (only with workers, as torch)
    with pytest.raises(ValueError, match="timeout"):
        DataLoader(ds, num_workers=1, timeout=-1)


def test_training_loop_reads_like_pytorch():
    x = np.random.randn(64, 4).astype(np.float32)
    y = (x.sum(1) > 0).astype(np.int64)
    model = zyx.nn.Linear(4, 2)
    opt = zyx.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        for bx, by in DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=0):
            loss = zyx.nn.functional.cross_entropy(model(bx), by)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0]


# -- worker processes ----------------------------------------------------------------------
class _Probe(Dataset):
    """Items that say where and how they were made: worker id, its seed, a draw from zyx's
    generator there, what worker_init_fn set; index 13 raises, index 17 kills its worker."""
    def __len__(self):
        return 24

    def __getitem__(self, i):
        from zyx.utils.data import get_worker_info
        if i == 13 and _Probe.fail:
            raise ValueError(f"bad item {i}")
        if i == 17 and _Probe.die:
            os._exit(3)
        info = get_worker_info()
        return {"i": np.int64(i), "x": np.full(3, i, np.float32),
                "worker": np.int64(info.id), "seed": np.int64(info.seed % (1 << 62)),
                "draw": np.float32(zyx.rand(1).item()), "init": np.int64(_INIT[0])}

    fail = False
    die = False


_INIT = [0]


def _init_worker(worker_id):
    _INIT[0] = 100 + worker_id


def test_workers_load_the_same_batches_in_order():
    ds = TensorDataset(*_arrays(37))
    plain = [[t.numpy() for t in b] for b in DataLoader(ds, batch_size=5)]
    loaded = [[t.numpy() for t in b] for b in DataLoader(ds, batch_size=5, num_workers=2)]
    assert len(loaded) == len(plain)
    for a, b in zip(plain, loaded):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    # a custom collate_fn making zyx tensors in the worker, and batch_size=None
    pairs = DataLoader(ds, batch_size=4, num_workers=3,
                       collate_fn=lambda s: (zyx.tensor(np.stack([x for x, _ in s])) * 2,
                                             [int(y) for _, y in s]))
    for k, (x, y) in enumerate(pairs):
        np.testing.assert_array_equal(x.numpy(), ds.tensors[0][4 * k:4 * k + 4] * 2)
        assert y == list(ds.tensors[1][4 * k:4 * k + 4])
    single = list(DataLoader(ds, batch_size=None, num_workers=2))
    np.testing.assert_array_equal(single[7][0].numpy(), ds.tensors[0][7])


def test_workers_are_seeded_and_initialized_like_torch():
    loader = DataLoader(_Probe(), batch_size=4, num_workers=2, worker_init_fn=_init_worker)
    batches = list(loader)
    ids = np.concatenate([b["i"].numpy() for b in batches])
    np.testing.assert_array_equal(ids, np.arange(24))              # in order
    workers_ = np.concatenate([b["worker"].numpy() for b in batches])
    assert set(workers_) == {0, 1}
    seeds = {int(w): int(s) for b in batches
             for w, s in zip(b["worker"].numpy(), b["seed"].numpy())}
    assert seeds[1] == seeds[0] + 1                              # base_seed + worker id
    inits = np.concatenate([b["init"].numpy() for b in batches])
    np.testing.assert_array_equal(inits, 100 + workers_)
    draws = [float(b["draw"].numpy()[0]) for b in batches[:2]]     # worker 0, then 1
    assert draws[0] != draws[1]
    again = [b["seed"].numpy()[0] for b in loader]
    assert again[0] != batches[0]["seed"].numpy()[0]               # a new base seed per epoch


def test_an_error_in_a_worker_is_raised_with_its_traceback():
    _Probe.fail = True
    try:
        with pytest.raises(ValueError, match="(?s)DataLoader worker process.*bad item 13"):
            list(DataLoader(_Probe(), batch_size=4, num_workers=2))
    finally:
        _Probe.fail = False

    def bad_init(worker_id):
        raise KeyError("no such setting")
    with pytest.raises(KeyError, match="worker_init_fn"):
        list(DataLoader(_Probe(), batch_size=4, num_workers=2, worker_init_fn=bad_init))


def test_a_dead_worker_is_an_error_not_a_hang():
    _Probe.die = True
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="exited unexpectedly with exit code 3"):
            list(DataLoader(_Probe(), batch_size=4, num_workers=2))
        assert time.monotonic() - start < 20
    finally:
        _Probe.die = False


class _Slow(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        time.sleep(3)
        return np.float32(i)


def test_worker_timeout():
    with pytest.raises(RuntimeError, match="timed out after 1 seconds"):
        list(DataLoader(_Slow(), batch_size=2, num_workers=1, timeout=1))


def test_iterable_dataset_with_workers_loads_in_the_main_process():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(np.arange(6, dtype=np.float32))
    with pytest.warns(UserWarning, match="main process"):
        loader = DataLoader(Stream(), batch_size=3, num_workers=2)
    np.testing.assert_array_equal(np.concatenate([b.numpy() for b in loader]), np.arange(6))


def test_a_batch_that_cannot_cross_processes_is_an_error_not_a_hang():
    ds = TensorDataset(*_arrays(8))
    loader = DataLoader(ds, batch_size=4, num_workers=1, collate_fn=lambda s: (lambda: s))
    with pytest.raises(Exception, match="sending a batch"):
        list(loader)
