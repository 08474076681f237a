"""The ranks compare their paths through the loop at points every rank passes (a task's end, before its metric
exchange; the fit's end), so that ranks whose paths parted raise `DesyncError` naming where, instead of meeting
in collectives that do not match.

Why the job's store and not a collective: the first collective after the paths part is the one that does not
match, and gloo ends a process outright (`gloo::EnforceNotMet`, no Python exception) when the sizes of two
collectives that met differ, e.g. a rank's end-of-task loss all-reduce meeting a peer's metric all-reduce of
one more validation batch. Through the store a rank that arrives writes its path and waits, issuing nothing a
peer's collective could meet. The cost is a few store round trips per task, none per batch.

At the n-th point each rank writes its place (`deepepochs.engine.rank_place.place`, with the path it took since
the last point) under `<prefix>/<n>/<rank>` and waits for its peers' up to `dist_timeout`. Then:

- every peer arrived: their cold transitions and points are compared (`path_compare`); a difference raises
  `DesyncError` on every rank, which sees the same records;
- a peer did not arrive in time: the error of a stalled job (`stall_report`), whose comparison of every rank's
  whole path (from the heartbeats) makes it a `DesyncError` when they parted.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable

import torch.distributed as dist

from deepepochs.errors import DesyncError, DistributedError
from deepepochs.parallel.path_compare import cold_paths, parting
from deepepochs.parallel.stall_report import rank_entry

__all__ = ["PathAgreement"]


class PathAgreement:
    """The agreement points of one process-group use: its own store connection, opened at the first point."""

    def __init__(self, address: tuple[str, int], rank: int, world_size: int, prefix: str, timeout: float):
        self.address, self.rank, self.world_size, self.prefix, self.timeout = address, rank, world_size, prefix, timeout
        self.points = 0  # agreement points passed
        self._store = None

    def _connect(self):
        if self._store is None:
            self._store = dist.TCPStore(*self.address, is_master=False, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=self.timeout))
        return self._store

    def agree(self, place: dict, stalled: Callable[[str, dict, str], DistributedError]) -> None:
        """Wait until every rank reached this point (`place['path']['waiting_at']` names it) and compare their
        paths; `stalled(what, place, said)` is the error when a peer does not arrive within the timeout."""
        point = place["path"]["waiting_at"]
        self.points += 1
        key = f"{self.prefix}/{self.points}"
        peers = [rank for rank in range(self.world_size) if rank != self.rank]
        try:
            store = self._connect()
            store.set(f"{key}/{self.rank}", json.dumps({**place, "time": time.time()}))
            store.wait([f"{key}/{rank}" for rank in peers], datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:  # a timeout (DistStoreError), or the store's host (rank 0) is gone
            said = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise stalled(f"the ranks did not all reach {point} within {self.timeout:g} s (Trainer(dist_timeout=...))",
                          place, said) from None
        places = {rank: json.loads(store.get(f"{key}/{rank}")) for rank in peers}
        places[self.rank] = {**place, "time": time.time()}
        if self.points > 1:  # every rank passed the previous point: nobody reads its records any more
            store.delete_key(f"{self.prefix}/{self.points - 1}/{self.rank}")
        parted = parting(cold_paths({rank: other["path"] for rank, other in places.items()}))
        if parted:
            lines = "\n".join(f"  rank {rank}: at {places[rank]['path']['waiting_at']}, state"
                              f" {places[rank]['state']!r}, stage {places[rank]['stage']!r}, epoch"
                              f" {places[rank]['epoch']}, batch {places[rank]['batch']}" for rank in sorted(places))
            error = DesyncError(f"rank {self.rank} of {self.world_size}: the ranks' paths through the loop parted: "
                                f"{parted}.\nWhere each rank compared its path:\n{lines}")
            error.parting = parted
            error.ranks = {rank: rank_entry(other, True) for rank, other in places.items()}
            raise error
