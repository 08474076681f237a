"""Where the ranks' paths through the loop part: the first transition, counted from the ranks' last agreement,
that the ranks took differently, in the loop's words.

Each rank's path is what `LoopMachine.path` gives (read from its heartbeat, or sent at an agreement point):
transitions `[index since the agreement, epoch, batch, source, trigger, dest]`, how many it took (`count`) and the
point where it waits for its peers (`waiting_at`), if it does. A rank that has not reached an index yet is behind,
not apart; a rank waiting at an agreement point where another took a transition has parted from it there.
"""

from __future__ import annotations

import functools

from deepepochs.fsm.machine import load_spec

__all__ = ["cold_paths", "parting"]


def cold_paths(paths: dict[int, dict | None]) -> dict[int, dict | None]:
    """The cold transitions of each path (a few per epoch), indexed by their order: how the ranks' paths compare
    at an agreement point, where a longer evaluation shard on one rank adds hot transitions and nothing else."""
    return {rank: None if path is None else
            {"entries": [[n, *entry[1:]] for n, entry in enumerate(path["cold"])], "count": len(path["cold"]),
             "waiting_at": path["waiting_at"]}
            for rank, path in paths.items()}


def _step(path: dict, index: int, entries: dict) -> tuple | None:
    """What a rank did at `index`: ('took', source, trigger, dest), ('waits', point), or None (not known)."""
    entry = entries.get(index)
    if entry is not None:
        return ("took", *entry[3:6])
    if index == path["count"] and path.get("waiting_at"):
        return ("waits", path["waiting_at"])
    return None


@functools.cache
def _inside_task(state: str) -> bool:
    """Whether `state` lies inside a task, where the batch counter says where the loop is (outside, it still
    holds the last task's count)."""
    try:
        return load_spec().state(state).layer not in ("fit", "epoch", "stage", "rollback")
    except StopIteration:  # a record of another version's loop: say the batch rather than nothing
        return True


def _when(entry: list) -> str:
    """'epoch 1, batch 3' inside a task, 'epoch 2' outside one."""
    return f"epoch {entry[1]}, batch {entry[2]}" if _inside_task(entry[3]) else f"epoch {entry[1]}"


def _words(step: tuple, entries: dict, index: int) -> str:
    if step[0] == "took":
        return f"took {step[1]} --{step[2]}--> {step[3]} ({_when(entries[index])})"
    before = entries.get(index - 1)
    after = f", after {_when(before)}" if before else ""
    return f"waits at {step[1]}{after}"


def parting(paths: dict[int, dict | None]) -> str | None:
    """The first transition since the last agreement where the ranks' paths part, as a sentence ("at transition
    9 since the ranks last agreed, rank 0 took task_val --begin_batch--> val_batch (epoch 1, batch 3); rank 1 waits
    at the end of validation task 1 of epoch 1, after epoch 1 batch 2"), or None while they agree as far as
    they are known."""
    known = {rank: path for rank, path in paths.items() if path}
    if len(known) < 2:
        return None
    entries = {rank: {entry[0]: entry for entry in path["entries"]} for rank, path in known.items()}
    for index in range(max(path["count"] for path in known.values()) + 1):
        steps = {rank: _step(path, index, entries[rank]) for rank, path in known.items()}
        groups: dict[tuple, list[int]] = {}
        for rank, step in steps.items():
            if step is not None:
                groups.setdefault(step, []).append(rank)
        if len(groups) > 1:
            said = []
            for step, ranks in groups.items():
                who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
                said.append(f"{who} {_words(step, entries[ranks[0]], index)}")
            return f"at transition {index + 1} since the ranks last agreed, " + "; ".join(said)
    return None
