"""NCCL over two GPUs of one machine, ranks started by tests/test_distributed.py with
torchrun's environment: how a collective fails when a peer is gone. Usage:
nccl_failure.py MODE TIMEOUT
  exit  rank 1 exits (without destroying its communicator) before the all_reduce that
        rank 0 then calls: rank 0 must raise DistributedError within about TIMEOUT
        seconds, not hang, and the process must then exit
  hang  rank 1 stays alive but never calls the all_reduce: the same on rank 0, and rank 1
        exits once rank 0 has reported (through a file, not NCCL)"""
import datetime
import os
import sys
import time

import numpy as np

import zyx
import zyx.distributed as dist


def main(mode, timeout, flag):
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    dev = f"cuda:{rank}"
    t = zyx.Tensor(np.ones(1 << 20, np.float32), device=dev)
    dist.all_reduce(t)                   # both ranks connected and working
    np.testing.assert_allclose(t.numpy()[:4], 2.0)
    dist.barrier()
    if rank == 1:
        if mode == "exit":
            os._exit(0)
        deadline = time.monotonic() + 10 * timeout
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        t.numpy()                        # the host waits here: the watchdog guards it
    except dist.DistributedError as e:
        secs = time.monotonic() - start
        msg = str(e)
        assert "all_reduce" in msg and "rank 0" in msg, msg
        print(f"rank 0: raised after {secs:.1f} s: {msg}", flush=True)
    else:
        print("rank 0: the all_reduce without its peer did not raise", flush=True)
        os._exit(1)
    finally:
        open(flag, "w").close()
    try:                                 # later collectives fail at once
        dist.all_reduce(t)
    except dist.DistributedError as e:
        assert "aborted" in str(e), e
    else:
        print("rank 0: a collective after the abort did not raise", flush=True)
        os._exit(1)
    dist.destroy_process_group()
    print(f"rank 0: nccl failure {mode} ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]), sys.argv[3]))
