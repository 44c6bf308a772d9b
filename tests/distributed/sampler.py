"""Run under `mpirun -np 3`: DistributedSampler takes rank and world size from the process
group; the ranks' shares (gathered with all_gather) cover the dataset, are disjoint apart
from the padding, have equal length, and change order with set_epoch."""
import sys

import numpy as np

import zyx
import zyx.distributed as dist
from zyx.utils.data import DistributedSampler


def gathered(sampler, world):
    mine = zyx.Tensor(np.array(list(sampler), np.int64))
    outs = [zyx.zeros(len(sampler), dtype=zyx.int64) for _ in range(world)]
    dist.all_gather(outs, mine)
    return [o.numpy() for o in outs]


def main():
    dist.init_process_group("mpi")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 3 * world + 1                   # not a multiple: padding
    s = DistributedSampler(list(range(n)))
    assert (s.rank, s.num_replicas) == (rank, world)
    parts = gathered(s, world)
    allidx = np.concatenate(parts)
    assert len(allidx) == s.total_size == world * len(s), (len(allidx), s.total_size)
    assert set(allidx.tolist()) == set(range(n)), "not every sample is seen"
    assert len(set(allidx.tolist())) == n and s.total_size - n == world - 1
    first = [p.copy() for p in parts]
    s.set_epoch(1)
    parts = gathered(s, world)
    assert set(np.concatenate(parts).tolist()) == set(range(n))
    assert any((a != b).any() for a, b in zip(first, parts)), "set_epoch changed nothing"
    d = DistributedSampler(list(range(n)), drop_last=True)
    parts = gathered(d, world)
    allidx = np.concatenate(parts)
    assert len(set(allidx.tolist())) == len(allidx) == 3 * world, "drop_last overlaps"
    dist.destroy_process_group()
    print(f"rank {rank}: sampler ok", flush=True)


if __name__ == "__main__":
    sys.exit(main())
