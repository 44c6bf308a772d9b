"""Run under `mpirun -np 2`: how a collective fails. Usage: failures.py MODE TIMEOUT
  exit      rank 1 exits before the all_reduce: rank 0 must not hang
  raise     rank 1 raises before the all_reduce: the job aborts at once
  hang      rank 1 never calls the all_reduce: rank 0 raises DistributedError after
            TIMEOUT seconds, naming the collective (and the job then aborts)
  mismatch  the ranks pass different shapes: every rank raises a clear DistributedError
            (the script checks the message and exits 0)"""
import datetime
import os
import sys
import time

import numpy as np

import zyx
import zyx.distributed as dist


def main(mode, timeout):
    dist.init_process_group("mpi", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    if mode == "mismatch":
        for shapes, kind in ((((3,), (4,)), "shape"), (((2, 2), (2, 2)), "dtype")):
            dtype = np.float32 if kind == "shape" or rank == 0 else np.float64
            t = zyx.Tensor(np.ones(shapes[rank], dtype))
            try:
                dist.all_reduce(t)
            except dist.DistributedError as e:
                msg = str(e)
                assert "all_reduce" in msg and "rank 0" in msg and "rank 1" in msg, msg
                assert ("(3,)" in msg and "(4,)" in msg) if kind == "shape" else \
                    ("float32" in msg and "float64" in msg), msg
                print(f"rank {rank}: mismatched {kind} raised: {msg}", flush=True)
            else:
                print(f"rank {rank}: mismatched {kind} did not raise", flush=True)
                sys.exit(1)
        # all_reduce_coalesced checks the whole list: a rank with one tensor more raises
        ts = [zyx.ones(3) for _ in range(2 + rank)]
        try:
            dist.all_reduce_coalesced(ts)
        except dist.DistributedError as e:
            assert "all_reduce_coalesced" in str(e) and "rank 1" in str(e), str(e)
            print(f"rank {rank}: mismatched list raised: {e}", flush=True)
        else:
            print(f"rank {rank}: mismatched list did not raise", flush=True)
            sys.exit(1)
        dist.barrier()     # the group still works after the error
        dist.destroy_process_group()
        return
    t = zyx.ones(4)
    if rank == 1:
        if mode == "exit":
            sys.stdout.flush()
            os._exit(3)
        if mode == "raise":
            raise ValueError("rank 1 fails on purpose")
        time.sleep(10 * timeout)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except dist.DistributedError as e:
        print(f"rank {rank}: raised after {time.monotonic() - start:.1f} s: {e}", flush=True)
        sys.exit(2)
    print(f"rank {rank}: all_reduce returned without its peer", flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
