"""Worker processes of a DataLoader (`num_workers > 0`), with torch's semantics.

Each worker is a process with its own task queue; tasks (a batch's indices) go to the
workers in turn, at most `prefetch_factor` per worker ahead of what the loop consumed, and
batches come back through one result queue and are yielded in order. Workers compute on
the host only: they send numpy arrays (`Host` marks the ones that become tensors), and the
main process makes the zyx tensors, so no worker starts a device of its own.

- Seeding: worker `i` seeds Python's `random` and zyx's generator with `base_seed + i`
  (`base_seed` drawn from zyx's generator for every epoch, as torch draws it from its
  own); `get_worker_info()` in the worker gives id, num_workers, seed and dataset.
- `worker_init_fn(worker_id)` runs in each worker before its first task.
- An exception in a worker (in the dataset, collate_fn or worker_init_fn) is raised in the
  main process, of the same type where it can be rebuilt, with the worker's traceback in
  its message.
- A worker that dies (killed, os._exit) makes the loop raise RuntimeError naming its pid
  and exit code within about a second instead of waiting forever; `timeout` > 0 bounds
  the wait for any batch.
"""
from __future__ import annotations

import multiprocessing
import pickle
import queue
import random
import time
import traceback

POLL_S = 0.5           # how often a waiting loop checks that its workers are alive
JOIN_S = 5.0           # how long a worker may take to exit before it is terminated


class WorkerInfo:
    """What `get_worker_info()` returns inside a worker (torch's fields)."""
    __slots__ = ("id", "num_workers", "seed", "dataset")

    def __init__(self, id, num_workers, seed, dataset):
        self.id, self.num_workers, self.seed, self.dataset = id, num_workers, seed, dataset

    def __repr__(self):
        return f"WorkerInfo(id={self.id}, num_workers={self.num_workers}, seed={self.seed})"


_info = [None]


def get_worker_info():
    """The WorkerInfo of this DataLoader worker process; None in the main process."""
    return _info[0]


class Host:
    """A numpy array a worker sends that the main process turns into a zyx tensor."""
    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array


class Failure:
    """An exception raised in a worker, carried to the main process with its traceback."""

    def __init__(self, exc, worker_id, where):
        self.name = type(exc).__name__
        self.text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.worker_id = worker_id
        self.where = where
        try:           # the type itself where the main process can import it again
            self.exc_type = pickle.loads(pickle.dumps(type(exc)))
        except Exception:
            self.exc_type = None

    def reraise(self):
        message = (f"Caught {self.name} {self.where}in DataLoader worker process "
                   f"{self.worker_id}.\nOriginal {self.text}")
        err = None
        if self.exc_type is not None:
            try:
                err = self.exc_type(message)
            except Exception:     # a constructor that takes other arguments
                err = None
        raise err if isinstance(err, BaseException) else RuntimeError(message)


def _worker_loop(work, job, tasks, results, worker_id, num_workers, seed, seed_fn, init_fn):
    """A worker's life: seed, init_fn, then `work(job, task)` for every task until None;
    results (or Failures) go to `results` as (task id, data). `job` (the dataset and what
    the loader does with it) comes once, with the process."""
    try:
        random.seed(seed)
        seed_fn(seed)
        _info[0] = WorkerInfo(worker_id, num_workers, seed, job[0])
        if init_fn is not None:
            init_fn(worker_id)
    except Exception as e:
        results.put((None, pickle.dumps(Failure(e, worker_id, "in worker_init_fn "))))
        return
    while True:
        task = tasks.get()
        if task is None:
            return
        task_id, arg = task
        try:
            data = work(job, arg)
        except Exception as e:
            data = Failure(e, worker_id, "")
        # pickled here, not in the queue's feeder thread, where a batch that cannot be
        # pickled would only be printed and the main process would wait for it forever
        try:
            blob = pickle.dumps(data, pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            blob = pickle.dumps(Failure(e, worker_id, "sending a batch "))
        results.put((task_id, blob))


def run(work, job, args, num_workers, convert, *, seed, seed_fn, init_fn=None,
        prefetch_factor=2, timeout=0, context=None):
    """Yield `convert(work(job, a))` for every `a` of the iterable `args`, in order,
    computed by `num_workers` worker processes (module docstring). `job[0]` is the
    dataset (get_worker_info's); tasks carry only `a` (indices), so what `job` holds
    (a collate_fn, a lambda) crosses to the workers once, as the process starts (under
    the spawn context it must pickle, as with torch). `context`: a multiprocessing
    context or its name (None: the platform's default)."""
    ctx = context if not (context is None or isinstance(context, str)) else \
        multiprocessing.get_context(context)
    results = ctx.Queue()
    queues = [ctx.Queue() for _ in range(num_workers)]
    procs = [ctx.Process(target=_worker_loop, daemon=True,
                         args=(work, job, queues[i], results, i, num_workers, seed + i,
                               seed_fn, init_fn))
             for i in range(num_workers)]
    for p in procs:
        p.start()
    args = iter(args)
    sent = received = 0
    done = {}
    try:
        def send():
            nonlocal sent
            for a in args:
                queues[sent % num_workers].put((sent, a))
                sent += 1
                return True
            return False

        for _ in range(max(prefetch_factor, 1) * num_workers):
            if not send():
                break
        while received < sent:
            while received not in done:
                task_id, blob = _next_result(results, procs, timeout)
                data = pickle.loads(blob)
                if task_id is None:          # a worker_init_fn failed
                    data.reraise()
                done[task_id] = data
            data = done.pop(received)
            received += 1
            if isinstance(data, Failure):
                data.reraise()
            send()
            yield convert(data)
    finally:
        _shut_down(procs, queues, results)


def _next_result(results, procs, timeout):
    """The next (task id, data) from the workers; RuntimeError when one died or after
    `timeout` seconds (0: no limit) without a result."""
    start = time.monotonic()
    while True:
        try:
            return results.get(timeout=POLL_S)
        except queue.Empty:
            pass
        dead = [p for p in procs if p.exitcode is not None]
        if dead:
            try:                # what it sent before it ended (a worker_init_fn failure)
                return results.get(timeout=POLL_S)
            except queue.Empty:
                pass
            p = dead[0]
            raise RuntimeError(f"DataLoader worker (pid {p.pid}) exited unexpectedly with exit "
                               f"code {p.exitcode}")
        if timeout and time.monotonic() - start > timeout:
            raise RuntimeError(f"DataLoader timed out after {timeout} seconds")


def _shut_down(procs, queues, results):
    """Ask every worker to stop, wait a little, end the ones that do not."""
    for q, p in zip(queues, procs):
        if p.exitcode is None:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + JOIN_S
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0))
        if p.exitcode is None:
            p.terminate()
            p.join(1)
    for q in queues + [results]:
        q.cancel_join_thread()
        q.close()
