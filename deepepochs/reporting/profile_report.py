"""What a profiled run's time went to, in words: the table, its text, the bottleneck's verdict and the
Chrome trace-event file (`deepepochs.ProfileCallback` hands these the `deepepochs.engine.profiling`
timeline's plain numbers; nothing here measures anything)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from deepepochs.errors import ConfigError
from deepepochs.fsm.schema import COSTS

__all__ = ["ADVICE", "CATEGORIES", "category_shares", "merge_traces", "profile_rows", "read_profile", "state_shares",
           "straggler_line", "summary_text", "table_rows", "trace_document", "verdict"]

#: The table's categories (the spec's costs), in the order the summary lists them.
CATEGORIES = tuple(COSTS)


def _row_name(key: tuple[str, str | None]) -> str:
    state, part = key
    return state if part is None else f"{state}/{part}"


def table_rows(totals: Mapping[tuple[str, str | None], list[int]], cost_of: Callable, wall_ns: int,
               device: Mapping[tuple[str, str | None], int] | None = None) -> list[dict]:
    """One row per `(state, part)` the run spent time in, the largest first: `{'state', 'category', 'count',
    'seconds', 'share'}` (`share`: of the run's wall time `wall_ns`); with `device` (`{(state, part): ns}` of
    a CUDA run) also `'device_seconds'`."""
    wall = max(wall_ns, 1)
    rows = [{"state": _row_name(key), "category": cost_of(key), "count": count, "seconds": ns / 1e9,
             "share": ns / wall} for key, (count, ns) in totals.items() if ns or count]
    if device is not None:
        keys = [key for key, (count, ns) in totals.items() if ns or count]
        for row, key in zip(rows, keys):
            row["device_seconds"] = device.get(key, 0) / 1e9
    rows.sort(key=lambda row: (-row["seconds"], row["state"]))
    return rows


def category_shares(rows: list[dict]) -> dict[str, float]:
    """`{category: share of the wall time}` over `rows`, every category present (0.0 where none)."""
    shares = dict.fromkeys(CATEGORIES, 0.0)
    for row in rows:
        shares[row["category"]] += row["share"]
    return shares


def state_shares(rows: list[dict]) -> dict[str, float]:
    """`{state: share}`: each state's rows (the state's own and the parts that ran inside it) added up, for
    the graph's heat map."""
    shares: dict[str, float] = {}
    for row in rows:
        state = row["state"].split("/", 1)[0]
        shares[state] = shares.get(state, 0.0) + row["share"]
    return shares


def profile_rows(profile) -> list[dict]:
    """The rows of `profile`: a `ProfileCallback` (its `table`) or a table itself; `ConfigError` otherwise."""
    table = getattr(profile, "table", profile)
    if not isinstance(table, list) or not all(isinstance(r, dict) and {"state", "share"} <= set(r) for r in table):
        raise ConfigError(f"profile must be a ProfileCallback or its table (got {type(profile).__name__})")
    if not table:
        raise ConfigError("profile: the ProfileCallback has profiled no run yet; fit, test or predict first")
    return table


def read_profile(path) -> list[dict]:
    """The table a trace file written by `ProfileCallback(trace=...)` holds (`otherData.table`); `ConfigError`
    for a file that is not one."""
    try:
        with open(path) as f:
            document = json.load(f)
        table = document["otherData"]["table"]
    except FileNotFoundError:
        raise ConfigError(f"--profile {path}: no such file") from None
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"--profile {path}: not a trace written by ProfileCallback(trace=...) (a JSON"
                          " object whose otherData holds the profile's table)") from None
    try:
        return profile_rows(table)
    except ConfigError:
        raise ConfigError(f"--profile {path}: its otherData.table is not a list of profile rows") from None


def _pct(share: float) -> str:
    return f"{100 * share:.0f} %"


#: Per bottleneck, the verdict's sentence: `{share}` of the `{run}`, its largest row (`{state}`, its last
#: part `{where}`, its `{part}` share and `{count}`). The data verdict also names the DataLoader's workers.
ADVICE = {
    "callbacks": "callbacks: {share} of the {run} in callback hooks, {part} in {where}; make that hook cheaper or"
                 " run it less often",
    "checkpoint": "checkpoint: {share} of the {run} writes checkpoints and snapshots ({where}, {count} times); write"
                  " them less often or to faster storage",
    "validation": "validation: {share} of the {run} validates; validate less often (val_freq, val_every_n_updates)"
                  " or on less data",
    "logging": "logging: {share} of the {run} prints or logs ({where}); log less often",
    "forward": "forward: {share} of the {run} in the model's forward pass and loss: the model's compute dominates;"
               " try precision='bf16' or 'fp16', a larger batch, or torch.compile",
    "backward": "backward: {share} of the {run} backpropagates: the model's compute dominates; try precision='bf16'"
                " or 'fp16', or a larger batch",
    "optimizer": "optimizer: {share} of the {run} unscales, clips and steps; try a fused or foreach optimizer, or"
                 " accumulate gradients over more batches",
    "other": "other: {share} of the {run} in the loop's own bookkeeping (most in {state})",
}


def verdict(rows: list[dict], run: str, train_workers: set | None) -> tuple[str | None, str | None]:
    """`(bottleneck, sentence)`: the category with the largest share and what to try about it (None, None
    for a run without rows). `train_workers`: the `num_workers` of the training DataLoaders fetched from."""
    if not rows:
        return None, None
    shares = category_shares(rows)
    top = max(CATEGORIES, key=lambda c: shares[c])
    share = _pct(shares[top])
    biggest = next(row for row in rows if row["category"] == top)
    where = biggest["state"].rsplit("/", 1)[-1]
    if top == "data":
        workers = sorted(w for w in (train_workers or ()) if w is not None)
        if workers and workers[0] == 0:
            return top, (f"data: {share} of the {run} waits for the training DataLoader (num_workers=0); try"
                         " num_workers > 0 or faster __getitem__")
        named = f" (num_workers={workers[0]})" if workers else ""
        return top, (f"data: {share} of the {run} waits for the training DataLoader{named}; try more workers,"
                     " pin_memory=True, or a faster __getitem__ or collate_fn")
    advice = ADVICE.get(top, ADVICE["other"])
    return top, advice.format(share=share, run=run, where=where, count=biggest["count"], state=biggest["state"],
                              part=_pct(biggest["share"]))


def summary_text(rows: list[dict], run: str, wall_s: float, verdict_text: str | None, limit: int = 12,
                 straggler: str | None = None) -> str:
    """The table as text: the categories' shares, the `limit` largest rows, the verdict and, under DDP, the
    straggler line."""
    shares = category_shares(rows)
    covered = sum(row["share"] for row in rows)
    lines = [f"Where the time goes ({run}: {wall_s:.3f} s wall, {100 * covered:.1f} % attributed)",
             "  " + "  ".join(f"{c} {100 * shares[c]:.1f}%" for c in CATEGORIES if shares[c] >= 0.0005)]
    width = max([len(row["state"]) for row in rows[:limit]] + [5])
    device = bool(rows) and "device_seconds" in rows[0]  # a CUDA run's device time per row
    lines.append(f"  {'state':<{width}}  {'category':<10}  {'count':>8}  {'seconds':>9}  {'share':>6}"
                 + "  device s" * device)
    for row in rows[:limit]:
        lines.append(f"  {row['state']:<{width}}  {row['category']:<10}  {row['count']:>8}  {row['seconds']:>9.4f}"
                     f"  {100 * row['share']:>5.1f}%" + (f"  {row['device_seconds']:>8.4f}" if device else ""))
    if len(rows) > limit:
        rest = rows[limit:]
        lines.append(f"  ({len(rest)} more rows: {sum(r['seconds'] for r in rest):.4f} s)")
    if verdict_text:
        lines.append(f"verdict: {verdict_text}")
    if straggler:
        lines.append(straggler)
    return "\n".join(lines)


def straggler_line(arrivals: list[list[int]]) -> str | None:
    """Who the others waited for at the gradient synchronisations: `arrivals[r]` holds the host-clock times
    (ns) rank r entered its last synchronising micro-batches, oldest first (the same synchronisations on every
    rank, so the lists are aligned from their ends). None with one rank or no synchronisation."""
    count = min((len(a) for a in arrivals), default=0)
    if len(arrivals) < 2 or not count:
        return None
    last_counts = [0] * len(arrivals)
    waited = 0
    for times in zip(*(a[len(a) - count:] for a in arrivals)):
        latest = max(times)
        last_counts[times.index(latest)] += 1
        waited += sum(latest - t for t in times)
    rank = max(range(len(arrivals)), key=last_counts.__getitem__)
    return (f"straggler: rank {rank} arrived last at {last_counts[rank]} of the last {count} gradient"
            f" synchronisations; the ranks waited {waited / 1e9:.3f} s for the last one in all")


def _complete(name: str, cat: str, t0: int, t1: int, origin: int, pid: int) -> dict:
    """A complete event (`ph: 'X'`), timestamps in microseconds from the run's start."""
    return {"name": name, "cat": cat, "ph": "X", "ts": (t0 - origin) / 1000, "dur": (t1 - t0) / 1000,
            "pid": pid, "tid": 0}


def trace_document(window, run: str, started: int, stopped: int, rank: int, table: list[dict],
                   started_wall: int = 0, operators=None) -> dict:
    """The Chrome trace-event document of a run's `TraceWindow`: the run, its epochs, the segments (each
    update and what led to it), and every state visit and part inside them, as complete events on one track
    (`pid` = the rank); `otherData` also holds the whole run's `table` (for the graph's heat map) and the
    host clock's time at its start, `started_wall` (ns; `merge_traces` lines ranks up by it).

    `operators` (an `OperatorTrace`, `ProfileCallback(torch_profiler=...)`): torch's events, on the same clock,
    the loop thread's on the loop's track (under the state each ran in), other threads' and streams' on tracks
    of their own beside it."""
    events = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
              {"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "loop"}},
              _complete(run, "run", started, stopped, started, rank)]
    events += [_complete(name, "epoch", t0, t1, started, rank) for name, t0, t1 in window.epochs]
    for name, t0, t1, visits in window.segments:
        events.append(_complete(name, "update", t0, t1, started, rank))
        events += [_complete(n, cat, a, b, started, rank) for n, cat, a, b in visits]
    other = {"producer": "deepepochs ProfileCallback", "run": run, "rank": rank,
             "trace_updates": window.segments.maxlen, "dropped_updates": window.dropped_segments,
             "dropped_events": window.dropped_events, "table": table, "started_wall": started_wall}
    if operators is not None:
        events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": lane, "args": {"name": name}}
                   for lane, name in operators.lanes.items()]
        for name, cat, t0, t1, lane, args in operators.events:
            event = {**_complete(name, cat, t0, t1, started, rank), "tid": lane}
            if args:
                event["args"] = args
            events.append(event)
        other["torch_profiler"] = {"windows": operators.windows, "events": len(operators.events),
                                   "unplaced_windows": operators.unplaced}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def merge_traces(documents: list[dict]) -> dict:
    """One document of the ranks' `trace_document`s (in rank order): each rank's events on its own process
    track, shifted so that the host clock lines them up (the earliest start is 0); `otherData` holds rank 0's
    table as `table` and every rank's own as `ranks`."""
    first = min(d["otherData"]["started_wall"] for d in documents)
    events = []
    for document in documents:
        shift = (document["otherData"]["started_wall"] - first) / 1000
        events += [{**e, "ts": e["ts"] + shift} if "ts" in e else e for e in document["traceEvents"]]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {**documents[0]["otherData"], "rank": None, "ranks": [d["otherData"] for d in documents]}}
