"""Each rank's place in the loop, published to the job's store by a background thread, and read back by a rank
whose collective failed, so that its error says where every rank was.

The thread (`Heartbeat`) asks a reader the engine gives it for this rank's place (the machine's state, the stage,
epoch, update and batch, the callback or collective the training thread is in: `deepepochs.engine.rank_place`)
every `HEARTBEAT_S` seconds and writes it, with the time, a beat counter, the process id and the host, under its
own key of the rendezvous store. Nothing runs per batch: the thread reads what the loop keeps anyway. It uses its
own connection to the store, so a main thread blocked in the store (or in a collective) never blocks it; it is a
daemon and ends at `close` (or at exit), so it never keeps a process alive.

`read_places` is the other side: every rank's last record, and whether each peer is alive (on the same host its
process is looked up; elsewhere its heartbeat must advance within a few beats). A rank that died stops beating; a
slow or hung one keeps beating from its thread while its loop stands still.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["HEARTBEAT_S", "Heartbeat", "read_places"]

#: Seconds between two beats of a rank.
HEARTBEAT_S = 1.0

# How long a store connection may take to open or answer (seconds): the store is local to the job.
_STORE_WAIT_S = 2.0


def _connect(address: str, port: int):
    """A fresh client connection to the job's store (its own socket: no other user's call can block it)."""
    return dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=_STORE_WAIT_S),
                         wait_for_workers=False)


class Heartbeat:
    """A daemon thread writing `read_place()` (a JSON-able dict) under `<prefix>/<rank>` every `interval` seconds.

    Attributes:
        last: the last record written (the place plus 'time', 'since' (when the place last changed), 'beat',
            'pid', 'host'), or None before the first.
    """

    def __init__(self, address: str, port: int, rank: int, prefix: str, read_place: Callable[[], dict],
                 interval: float = HEARTBEAT_S):
        self.address, self.port, self.rank, self.prefix, self.interval = address, port, rank, prefix, interval
        self._read_place = read_place
        self._stop = threading.Event()
        self._since = time.time()
        self._place = None
        self.last: dict | None = None
        self._thread = threading.Thread(target=self._run, name=f"deepepochs-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _record(self, beat: int) -> dict:
        """This rank's place now, with when it last changed."""
        place = self._read_place()
        now = time.time()
        if place != self._place:
            self._place, self._since = place, now
        return {**place, "time": now, "since": self._since, "beat": beat, "pid": os.getpid(),
                "host": socket.gethostname()}

    def _run(self) -> None:
        try:
            store = _connect(self.address, self.port)
        except RuntimeError:  # the store is gone already (rank 0 ended): nothing to publish to
            return
        beat = 0
        while not self._stop.is_set():
            try:
                record = self._record(beat)
            except Exception:  # noqa: BLE001 (the loop changed under the reader: read again next beat)
                record = None
            if record is not None:
                try:
                    store.set(f"{self.prefix}/{self.rank}", json.dumps(record))
                except RuntimeError:  # the store's host (rank 0) is gone: peers can no longer read anyway
                    return
                self.last = record
            beat += 1
            self._stop.wait(self.interval)

    def close(self) -> None:
        """Stop the thread (it ends within one beat; as a daemon it never holds the process anyway)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self.interval + _STORE_WAIT_S)


def _process_gone(record: dict) -> bool | None:
    """Whether the process that wrote `record` has ended (True), still runs (False), or cannot be looked up from
    here (None: another host)."""
    if record.get("host") != socket.gethostname():
        return None
    pid = int(record["pid"])
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")  # a zombie has ended: only its parent has not collected it yet
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return None
        return False


def _records(store, prefix: str, ranks) -> dict[int, dict | None]:
    records = {}
    for rank in ranks:
        key = f"{prefix}/{rank}"
        records[rank] = json.loads(store.get(key)) if store.check([key]) else None
    return records


def read_places(address: str, port: int, prefix: str, world_size: int, me: int, interval: float = HEARTBEAT_S
                ) -> tuple[dict[int, dict | None], dict[int, bool | None]]:
    """Every peer's last record (None: none read) and whether it is alive (None: unknown), as seen from rank `me`.

    A peer on this host is alive while its process runs; elsewhere, while its beat advances within 2.5 beats. When
    the store cannot be reached, rank 0, which serves it, is dead and the others unknown."""
    peers = [rank for rank in range(world_size) if rank != me]
    try:
        store = _connect(address, port)
        records = _records(store, prefix, peers)
    except RuntimeError:
        return dict.fromkeys(peers), {rank: (False if rank == 0 else None) for rank in peers}
    alive = {rank: None if record is None else _process_gone(record) for rank, record in records.items()}
    alive = {rank: None if gone is None else not gone for rank, gone in alive.items()}
    undecided = [rank for rank in peers if records[rank] is not None and alive[rank] is None]
    if undecided:
        time.sleep(2.5 * interval)
        try:
            again = _records(store, prefix, undecided)
        except RuntimeError:
            again = {}
        for rank in undecided:
            newer = again.get(rank)
            alive[rank] = newer is not None and newer["beat"] > records[rank]["beat"]
            records[rank] = newer or records[rank]
    return records, alive
