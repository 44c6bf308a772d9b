"""The default process group: which backend, this process's rank and the world size, the
timeout; where they come from (torchrun's or an MPI launcher's environment); and the small
TCP key-value store NCCL ranks meet through (a rendezvous: it carries the communicator's
unique id, never tensor data)."""
from __future__ import annotations

import datetime
import os
import threading
import time
from multiprocessing.connection import Client, Listener

from .work import DistributedError

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)

# (rank, world size, local rank) variables, first match wins: torchrun, Open MPI, MPICH /
# Intel MPI (PMI), PMIx, Slurm
_ENV_SETS = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def env_rank_world():
    """(rank, world size, local rank) from the launcher's environment, or None when no
    launcher set them (a plain `python script.py`)."""
    env = os.environ
    for r, w, lr in _ENV_SETS:
        if r in env and w in env:
            return int(env[r]), int(env[w]), int(env.get(lr, env[r]))
    return None


def launched_by_mpi() -> bool:
    """True when an MPI launcher (mpirun, mpiexec, srun with PMI) started this process."""
    env = os.environ
    return any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def as_seconds(timeout) -> float:
    """A timedelta or a number of seconds, as seconds."""
    if timeout is None:
        return DEFAULT_TIMEOUT.total_seconds()
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


class ProcessGroup:
    """The default group: `backend` (an MpiBackend or NcclBackend), `rank`, `size`,
    `timeout` (seconds)."""

    def __init__(self, backend, name, rank, size, local_rank, timeout):
        self.backend = backend
        self.name = name
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.timeout = timeout


class State:
    """The one default process group of this process (None until init_process_group),
    and the rendezvous store it opened (closed by destroy_process_group)."""
    group = None
    own_store = None


_AUTH = b"zyx-distributed-rendezvous"


class TCPStore:
    """torch.distributed.TCPStore's core: `set(key, value)`, `get(key)` (waits until some
    rank set it, up to `timeout` seconds). The master (rank 0) serves it on host:port from a
    thread; every rank, the master too, is a client. Values are pickled by
    multiprocessing.connection; the store only meets the ranks, tensors never pass here."""

    def __init__(self, host, port, world_size, is_master, timeout=300.0):
        self.timeout = float(timeout)
        self._data = {}
        self._cond = threading.Condition()
        self._listener = None
        if is_master:
            self._listener = Listener((host, int(port)), authkey=_AUTH)
            threading.Thread(target=self._serve, daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._conn = Client((host, int(port)), authkey=_AUTH)
                break
            except (ConnectionRefusedError, OSError) as e:
                if time.monotonic() > deadline:
                    raise DistributedError(
                        f"could not reach the rendezvous store at {host}:{port} within "
                        f"{self.timeout:g} s ({e}): is rank 0 running and MASTER_ADDR/"
                        "MASTER_PORT the same on every rank?") from None
                time.sleep(0.05)

    def _serve(self):
        while True:
            try:
                conn = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn):
        try:
            while True:
                cmd, key, value = conn.recv()
                with self._cond:
                    if cmd == "set":
                        self._data[key] = value
                        self._cond.notify_all()
                        conn.send(True)
                        continue
                    ok = self._cond.wait_for(lambda: key in self._data, value)
                    conn.send((ok, self._data.get(key)))
        except (EOFError, OSError):
            conn.close()

    def set(self, key: str, value) -> None:
        """Store `value` under `key` for every rank."""
        self._conn.send(("set", key, value))
        self._conn.recv()

    def get(self, key: str):
        """The value stored under `key`, waiting for it up to the store's timeout."""
        self._conn.send(("get", key, self.timeout))
        ok, value = self._conn.recv()
        if not ok:
            raise DistributedError(f"rendezvous: no rank set {key!r} within "
                                   f"{self.timeout:g} s (did rank 0 fail to start?)")
        return value

    def close(self):
        """Disconnect (the master also stops serving)."""
        self._conn.close()
        if self._listener is not None:
            self._listener.close()
