"""The words of a stalled job: every rank's last place (`Heartbeat` records) turned into one sentence that says who
waits for whom, and the `DistributedError` that carries them.

"rank 1 is in validation (stage 'val', epoch 1, batch 3, in callback Sleep.on_val_batch) since 21 s; rank 0 waits
in the gradient all-reduce of update 18". A rank whose process ended is named dead, with the place it was last
seen in; a rank that is in no collective is the one the others wait for.
"""

from __future__ import annotations

import time

from deepepochs.errors import DesyncError, DistributedError
from deepepochs.parallel.path_compare import parting

__all__ = ["PLACE_KEYS", "rank_entry", "stall_error", "stall_sentence"]

#: The keys of each rank's entry in `DistributedError.ranks` (besides 'alive', 'callback', 'stop' and
#: 'seconds_in_place').
PLACE_KEYS = ("state", "stage", "epoch", "update", "batch", "collective", "seconds_since_heartbeat")

_STAGES = {"train": "training", "val": "validation", "test": "test", "predict": "prediction"}


def rank_entry(record: dict | None, alive: bool | None, now: float | None = None) -> dict:
    """A rank's entry of `.ranks` from its last heartbeat record (None: none was read)."""
    now = time.time() if now is None else now
    record = record or {}
    entry = {key: record.get(key) for key in PLACE_KEYS}
    entry["seconds_since_heartbeat"] = round(now - record["time"], 1) if "time" in record else None
    entry["seconds_in_place"] = round(now - record["since"], 1) if "since" in record else None
    entry["callback"] = record.get("callback")
    entry["stop"] = record.get("stop")
    entry["alive"] = alive
    return entry


def _where(entry: dict) -> str:
    """'validation (stage 'val', epoch 1, batch 3, in callback X.on_val_batch)'."""
    stage = entry.get("stage")
    details = [f"stage {stage!r}"] if stage else []
    details += [f"{name} {entry[name]}" for name in ("epoch", "batch") if entry.get(name) is not None]
    if entry.get("callback"):
        details.append(f"in callback {entry['callback']}")
    details.append(f"state {entry.get('state')!r}")
    words = _STAGES.get(stage, "no stage") if stage else "no stage"
    return f"{words} ({', '.join(details)})"


def _collective(entry: dict) -> str:
    update = f" of update {entry['update']}" if entry.get("stage") == "train" and entry.get("update") else ""
    return f"{entry['collective']}{update}"


def stall_sentence(ranks: dict[int, dict]) -> str:
    """One sentence naming where every rank is: dead ranks, ranks outside any collective (whom the others wait
    for) and, grouped by collective, the ranks that wait."""
    parts, waiting = [], {}
    for rank in sorted(ranks):
        entry = ranks[rank]
        if entry["alive"] is False:
            seen = f"; last seen in {_where(entry)}" if entry.get("state") else ""
            parts.append(f"rank {rank} is dead (its process ended{seen})")
        elif entry.get("state") is None:
            parts.append(f"rank {rank}'s place is unknown (no heartbeat could be read)")
        elif entry.get("collective"):
            waiting.setdefault(_collective(entry), []).append(rank)
        else:
            since = entry.get("seconds_in_place")
            parts.append(f"rank {rank} is in {_where(entry)}" + (f" since {since:.0f} s" if since is not None else ""))
    for collective, group in waiting.items():
        who = f"rank {group[0]} waits" if len(group) == 1 else f"ranks {', '.join(map(str, group))} wait"
        parts.append(f"{who} in the {collective}")
    return "; ".join(parts)


def stall_error(rank: int, world_size: int, what: str, ranks: dict[int, dict], said: str,
                paths: dict[int, dict | None] | None = None) -> DistributedError:
    """The error of rank `rank` whose collective failed (`what`: how), naming every rank's place: the sentence
    first, then one line per rank, then what torch said. `.ranks` holds the entries. When the ranks' `paths`
    (`LoopMachine.path`, from their heartbeats) part, a `DesyncError` naming where, first."""
    lines = []
    for other in sorted(ranks):
        entry = ranks[other]
        shown = ", ".join(f"{key} {entry[key]!r}" for key in (*PLACE_KEYS, "callback", "stop", "alive")
                          if entry.get(key) is not None)
        lines.append(f"  rank {other}: {shown or 'nothing known'}")
    parted = parting(paths) if paths else None
    apart = f"the ranks' paths parted: {parted}. " if parted else ""
    error = (DesyncError if parted else DistributedError)(
        f"rank {rank} of {world_size}: {what}: {apart}{stall_sentence(ranks)}.\nEvery rank's last place (from the"
        " ranks' heartbeats):\n" + "\n".join(lines) + f"\nTorch said: {said}")
    error.ranks = ranks
    if parted:
        error.parting = parted
    return error
