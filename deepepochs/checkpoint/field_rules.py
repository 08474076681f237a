"""The rules every field read back from a checkpoint must follow, checked before anything is applied.

`problems(trainer, ckpt)` returns what breaks the rules, each naming the field, what it must be and the
type (and value) found; `check_fits` turns them into one `CheckpointError`. States that mirror a live
object's follow `deepepochs.checkpoint.value_rules.like`; optimizer states,
`deepepochs.checkpoint.optimizer_rules`; the fields a file holds of its own (epoch, world size, order seed,
history, a snapshot's position) have their types and ranges here, the run-state fields a snapshot stores
as they are in `deepepochs.checkpoint.run_rules`. The same module checks the run-end and
progress records (`finished_problems`, `progress_problems`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from deepepochs.checkpoint.format import FORMAT_VERSION, Checkpoint, monitors_of
from deepepochs.checkpoint.optimizer_rules import optimizer_problems
from deepepochs.checkpoint.run_rules import carried_state, generator_state, run_problems
from deepepochs.checkpoint.value_rules import MAX_COUNT, MAX_INT, MAX_TEXT, got, int_field, is_number, like
from deepepochs.engine.runstate import VAL_POINT_KEY
from deepepochs.utils import rng_state

__all__ = ["finished_problems", "problems", "progress_problems"]


# ---- the whole file ----
def _carried(value, world_size, out: list) -> None:
    """`carried`: None (an older file) or one rank's carried state (or None: it could not be stored) per
    rank of the file's `world_size`, in rank order."""
    if value is None:
        return
    if not isinstance(value, list) or len(value) != world_size:
        found = f"{len(value)} entries" if isinstance(value, list) else got(value)
        out.append(f"carried must be None or a list of one carried state per rank ({world_size}, the file's"
                   f" world_size; got {found})")
        return
    for rank, entry in enumerate(value):
        if entry is not None:
            carried_state(entry, f"carried[{rank}]", out)


def _callbacks(value, out: list) -> None:
    """`callbacks`: None (an older file, or no callback keeping a state) or the callbacks' states by name,
    each as `position.encode` stores it. The states are the callbacks' own, so only their encoding has a rule."""
    if value is None:
        return
    if not isinstance(value, Mapping) or not all(isinstance(name, str) for name in value):
        out.append(f"callbacks must be None or a dict of callback states by name (got {got(value)})")
        return
    for name, state in value.items():
        _encoded_value(state, f"callbacks[{name!r}]", out)


def _encoded_value(value, field: str, out: list) -> None:
    """What `position.encode` writes: None, a bool, number, string or tensor, a list of those, or a dict
    tagged `__dict__` (str keys) or `__tuple__` (a list), recursively."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _encoded_value(item, f"{field}[{i}]", out)
        return
    if isinstance(value, Mapping) and len(value) == 1 and "__tuple__" in value and isinstance(value["__tuple__"], list):
        _encoded_value(value["__tuple__"], field, out)
        return
    if isinstance(value, Mapping) and len(value) == 1 and isinstance(value.get("__dict__"), Mapping) \
            and all(isinstance(k, str) for k in value["__dict__"]):
        for k, item in value["__dict__"].items():
            _encoded_value(item, f"{field}[{k!r}]", out)
        return
    out.append(f"{field} must be a stored callback state (tensors, numbers, strings, and lists, tuples or"
               f" str-keyed dicts of them, as deepepochs writes them; got {got(value)})")


def problems(trainer, ckpt: Checkpoint) -> list[str]:
    """Every way `ckpt` (its optimizer states already in the trainer's parameter order,
    `names.by_name`) breaks the rules against `trainer`; empty when it may be applied."""
    out: list[str] = []
    int_field(ckpt.format_version, "format_version", 1, FORMAT_VERSION, out)
    int_field(ckpt.epoch, "epoch", 0, MAX_COUNT, out)
    int_field(ckpt.world_size, "world_size", 1, 1 << 20, out)
    int_field(ckpt.order_seed, "order_seed", 0, MAX_INT - 1, out, none=True)
    if not isinstance(ckpt.running_id, str) or len(ckpt.running_id) > MAX_TEXT:
        out.append(f"running_id must be a string of at most {MAX_TEXT} characters (got {got(ckpt.running_id)})")
    _model(trainer, ckpt.model, out)
    optimizer_problems(trainer, ckpt, out)
    if not isinstance(ckpt.schedulers, (list, tuple)) or len(ckpt.schedulers) != len(ckpt.optimizers):
        out.append(f"schedulers must be a list of one state (or None) per optimizer (got {got(ckpt.schedulers)})")
    else:
        for i, (item, state) in enumerate(zip(trainer.opt.items, ckpt.schedulers)):
            if state is not None and item.scheduler is not None:
                like(state, item.scheduler.state_dict(), f"schedulers[{i}]", out)
            elif state is not None and not isinstance(state, Mapping):
                out.append(f"schedulers[{i}] must be a dict or None (got {got(state)})")
    live_scaler = trainer.precision.state_dict()
    if ckpt.scaler is not None and live_scaler is not None:
        like(ckpt.scaler, live_scaler, "scaler", out)
    elif ckpt.scaler is not None and not isinstance(ckpt.scaler, Mapping):
        out.append(f"scaler must be a dict or None (got {got(ckpt.scaler)})")
    for monitor in monitors_of(trainer):
        saved = ckpt.monitors.get(monitor.monitor_id)
        if saved is None:
            continue
        live = monitor.state_dict()
        field = f"monitors[{monitor.monitor_id!r}]"
        if not isinstance(saved, Mapping) or not set(saved) <= set(live):
            out.append(f"{field} must be a dict with keys among {sorted(live)} (got {got(saved)})")
            continue
        for key, value in saved.items():
            if key == "last" and isinstance(value, float) and math.isnan(value):
                continue  # the last epoch's value: NaN for an epoch whose every update was skipped
            like(value, live[key], f"{field}[{key!r}]", out, key)
    if isinstance(ckpt.rng, Mapping) and "ranks" in ckpt.rng:  # a DDP run's: every rank's, in rank order
        ranks = ckpt.rng["ranks"]
        if not isinstance(ranks, list) or len(ranks) != ckpt.world_size:
            found = f"{len(ranks)} states" if isinstance(ranks, list) else got(ranks)
            out.append(f"rng['ranks'] must be a list of one generator state per rank ({ckpt.world_size}, the file's"
                       f" world_size; got {found})")
        else:
            for rank, state in enumerate(ranks):
                _rng(state, f"rng['ranks'][{rank}]", out)
    elif ckpt.rng is not None:
        _rng(ckpt.rng, "rng", out)
    _history(ckpt.history, ckpt.epoch, "history", out, ckpt.updates)
    _averages(trainer, ckpt.averages, out)
    _carried(ckpt.carried, ckpt.world_size, out)
    _callbacks(ckpt.callbacks, out)
    if ckpt.position is not None:
        _position(trainer, ckpt.position, ckpt.epoch, out)
    return out


def _averages(trainer, saved, out: list) -> None:
    """The weight averages the trainer holds must be like its own (tensors of the same dtypes and shapes,
    int counters); one the trainer does not hold is not read."""
    if saved is None:
        return
    if not isinstance(saved, Mapping):
        out.append(f"averages must be a dict of weight averages by id, or None (got {got(saved)})")
        return
    live = trainer.loop.run.averages or {}
    for average_id, state in saved.items():
        if average_id in live:
            like(state, live[average_id], f"averages[{average_id!r}]", out)


def _model(trainer, saved, out: list) -> None:
    """The model's entries must be tensors, its parameters finite (a buffer may hold inf: a mask); keys and
    shapes are the fit check's."""
    parameters = {name for name, _ in trainer.raw_model.named_parameters()}
    bad = []
    for key, value in saved.items():
        if not isinstance(value, torch.Tensor):
            if not (isinstance(key, str) and key.endswith("_extra_state")):
                bad.append(f"model[{key!r}] must be a tensor (got {got(value)})")
        elif key in parameters and value.device.type != "meta" and value.is_floating_point() \
                and not bool(torch.isfinite(value).all()):
            bad.append(f"model[{key!r}] must be finite, it is a parameter (got {got(value)} holding inf or NaN)")
    out.extend(bad[:5])


def _rng(saved, field: str, out: list) -> None:
    live = rng_state()
    if not isinstance(saved, Mapping) or not {"python", "numpy", "torch"} <= set(saved):
        out.append(f"{field} must be a dict of the 'python', 'numpy', 'torch' and 'cuda' generator states (got"
                   f" {got(saved)})")
        return
    python = saved["python"]
    ok = (isinstance(python, (list, tuple)) and len(python) == 3 and isinstance(python[0], int)
          and isinstance(python[1], (list, tuple)) and len(python[1]) == len(live["python"][1])
          and all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 2**32 for k in python[1])
          and (python[2] is None or (is_number(python[2]) and math.isfinite(python[2]))))
    if not ok:  # (version, 625 words of 32 bits, the cached gaussian: None or a number)
        out.append(f"{field}['python'] must be Python's generator state [version, {len(live['python'][1])} ints"
                   f" in [0, 2**32), None or a finite number] (got {got(python)})")
    for key in ("numpy", "torch"):
        like(saved[key], live[key], f"{field}[{key!r}]", out, key)
    loaders = saved.get("loaders", [])  # the training DataLoaders' own generators (put back as they are met)
    if not isinstance(loaders, list):
        out.append(f"{field}['loaders'] must be a list of generator states (got {got(loaders)})")
    else:
        for i, state in enumerate(loaders):
            generator_state(state, f"{field}['loaders'][{i}]", out)
    cuda = saved.get("cuda", [])
    if not isinstance(cuda, list) or not all(isinstance(s, torch.Tensor) and s.dtype == torch.uint8 and s.dim() == 1
                                             for s in cuda):
        out.append(f"{field}['cuda'] must be a list of uint8 generator states (got {got(cuda)})")
    loaders = saved.get("loaders", [])
    if not isinstance(loaders, list) or not all(map(_generator_state, loaders)):
        out.append(f"{field}['loaders'] must be a list of the training DataLoaders' generator states (uint8 tensors"
                   f" of {_CPU_STATE} bytes for a CPU generator, {_PHILOX_STATE} for an accelerator's) (got"
                   f" {got(loaders)})")
    streams = saved.get("streams", [])
    if not isinstance(streams, list) or not all(_state_dict(state) for state in streams):
        out.append(f"{field}['streams'] must be a list of the training datasets' state_dict() (dicts with string"
                   f" keys) (got {got(streams)})")


#: The bytes of a CPU generator's state (Mersenne Twister) and of an accelerator's (Philox: seed, offset).
_CPU_STATE = int(torch.get_rng_state().numel())
_PHILOX_STATE = 16


def _generator_state(value) -> bool:
    """Whether `value` can be a `torch.Generator`'s `get_state()`."""
    return (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1
            and value.numel() in (_CPU_STATE, _PHILOX_STATE))


def _state_dict(value) -> bool:
    """Whether `value` can be a stateful dataset's or loader's `state_dict()`: a dict with string keys."""
    return isinstance(value, Mapping) and all(isinstance(key, str) for key in value)


def _history(history, epochs: int, field: str, out: list, updates: int | None = None) -> None:
    """A run's records: `{stage: {name: [number per epoch]}}`, no list longer than the epochs completed; a
    stage recorded per validation point (it has the `updates` column of the update clock) has one row per
    point: no list longer than the `updates` committed (when the file says)."""
    if history is None:
        return
    if not isinstance(history, Mapping):
        out.append(f"{field} must be a dict of stages (got {got(history)})")
        return
    for stage, metrics in history.items():
        where = f"{field}[{stage!r}]"
        if not isinstance(stage, str) or not isinstance(metrics, Mapping):
            out.append(f"{where} must be a dict of metric names to lists (got {got(metrics)})")
            continue
        per_point = VAL_POINT_KEY in metrics
        limit, unit = (updates, "update(s) committed") if per_point else (epochs, "epoch(s) completed")
        for name, values in metrics.items():
            if not isinstance(name, str) or not isinstance(values, list) or not all(map(is_number, values)):
                out.append(f"{where}[{name!r}] must be a list of numbers (got {got(values)})")
            elif isinstance(limit, int) and len(values) > limit:
                out.append(f"{where}[{name!r}] holds {len(values)} values, more than the {limit} {unit}")


# ---- a snapshot's position ----
def _position(trainer, pos, epoch, out: list) -> None:
    """A mid-epoch snapshot's position (`deepepochs.engine.position`): its counters, its ranks' records."""
    if not isinstance(pos, Mapping):
        out.append(f"position must be a dict or None (got {got(pos)})")
        return
    keys = {"epoch", "task_index", "batches_done", "world_size", "batch_size", "samples_done", "ranks"}
    if not keys - {"batch_size", "samples_done"} <= set(pos) or not set(pos) <= keys:
        out.append(f"position must have the keys {sorted(keys)} (got {sorted(map(str, pos))})")
        return
    if isinstance(epoch, int) and pos["epoch"] != epoch + 1:
        out.append(f"position['epoch'] must be the epoch after the {epoch} completed, {epoch + 1} (got"
                   f" {got(pos['epoch'])})")
    int_field(pos["task_index"], "position['task_index']", 0, 1 << 16, out)
    int_field(pos["batches_done"], "position['batches_done']", 0, MAX_COUNT, out)
    int_field(pos["world_size"], "position['world_size']", 1, 1 << 20, out)
    int_field(pos.get("batch_size"), "position['batch_size']", 1, MAX_COUNT, out, none=True)
    int_field(pos.get("samples_done"), "position['samples_done']", 0, MAX_COUNT, out, none=True)
    size, samples = pos.get("batch_size"), pos.get("samples_done")
    if (size is None) != (samples is None):
        out.append(f"position['batch_size'] and position['samples_done'] must both be None (data without a batch"
                   f" size) or both ints (got {got(size)} and {got(samples)})")
    elif all(isinstance(v, int) and not isinstance(v, bool) for v in (size, samples, pos["batches_done"],
                                                                        pos["world_size"])) \
            and samples != pos["batches_done"] * size * pos["world_size"]:
        out.append(f"position['samples_done'] must be batches_done x batch_size x world_size,"
                   f" {pos['batches_done'] * size * pos['world_size']} (got {got(samples)})")
    ranks = pos["ranks"]
    if not isinstance(ranks, list) or (isinstance(pos["world_size"], int) and len(ranks) != pos["world_size"]):
        out.append(f"position['ranks'] must be a list of one record per process (got {got(ranks)})")
        return
    for r, rank in enumerate(ranks):
        _rank(trainer, rank, pos["task_index"], f"position['ranks'][{r}]", out)


def _rank(trainer, rank, task_index, field: str, out: list) -> None:
    if not isinstance(rank, Mapping) or not {"meters", "random"} <= set(rank) \
            or not set(rank) <= {"meters", "random", "data", "run"}:
        out.append(f"{field} must be a dict of 'meters', 'random', 'data' and 'run' (got {got(rank)})")
        return
    meters = rank["meters"]
    if not isinstance(meters, list) or (isinstance(task_index, int) and len(meters) != task_index + 1):
        out.append(f"{field}['meters'] must be a list of one record per training task so far (got {got(meters)})")
    else:
        for t, state in enumerate(meters):
            _meters(state, f"{field}['meters'][{t}]", out)
    random_states = rank["random"]
    if not isinstance(random_states, Mapping) or "commit" not in random_states:
        out.append(f"{field}['random'] must be a dict of generator states (got {got(random_states)})")
    else:
        for key in ("commit", "task"):
            _generator_pair(random_states.get(key), f"{field}['random'][{key!r}]", out, none=key == "task")
        if random_states.get("host") is not None:
            _rng(random_states["host"], f"{field}['random']['host']", out)
    data = rank.get("data")
    if data is not None and not _state_dict(data):
        out.append(f"{field}['data'] must be None or the training data's state_dict() (a dict with string keys)"
                   f" (got {got(data)})")
    run_problems(trainer, rank.get("run"), f"{field}['run']", out)


def _generator_pair(value, field: str, out: list, none: bool) -> None:
    """torch's (CPU, accelerator) generator states: a list of two, each a uint8 tensor or None."""
    if value is None and none:
        return
    ok = (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], torch.Tensor)
          and all(s is None or (isinstance(s, torch.Tensor) and s.dtype == torch.uint8 and s.dim() == 1)
                  for s in value))
    if ok:
        ok = value[0].shape == torch.get_rng_state().shape
    if not ok:
        out.append(f"{field} must be [CPU generator state, accelerator generator state or None] (uint8 tensors)"
                   f" (got {got(value)})")


def _meters(state, field: str, out: list) -> None:
    keys = {"loss_sum", "host_sum", "host", "count", "skipped", "patches"}
    if not isinstance(state, Mapping) or not set(state) <= keys or not keys - {"skipped"} <= set(state):
        out.append(f"{field} must be a dict of {sorted(keys)} (got {got(state)})")
        return
    loss = state["loss_sum"]
    if loss is not None and (not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point()):
        out.append(f"{field}['loss_sum'] must be None or a 0-d float tensor (got {got(loss)})")
    if not is_number(state["host_sum"]) or not math.isfinite(state["host_sum"]):
        out.append(f"{field}['host_sum'] must be a finite number (got {got(state['host_sum'])})")
    if state["host"] is not None and not isinstance(state["host"], bool):
        out.append(f"{field}['host'] must be None or a bool (got {got(state['host'])})")
    int_field(state["count"], f"{field}['count']", 0, MAX_COUNT, out)
    int_field(state.get("skipped", 0), f"{field}['skipped']", 0, MAX_COUNT, out)
    patches = state["patches"]
    if not isinstance(patches, Mapping):
        out.append(f"{field}['patches'] must be a dict of metric names to patches (got {got(patches)})")
        return
    for name, patch in patches.items():
        ok = (isinstance(name, str) and isinstance(patch, Mapping) and set(patch) == {"class", "fields", "callables"}
              and isinstance(patch["class"], str) and isinstance(patch["fields"], Mapping)
              and isinstance(patch["callables"], list) and all(isinstance(c, str) for c in patch["callables"]))
        if not ok:
            out.append(f"{field}['patches'][{name!r}] must be a dict of 'class' (str), 'fields' (dict) and"
                       f" 'callables' (list of str) (got {got(patch)})")


# ---- the run-end and progress records ----
def finished_problems(data, ckpt_epoch: int, ckpt_history) -> list[str]:
    """Every way a run-end record (`finished.pt`) breaks its rules, for a resume that loaded a checkpoint of
    `ckpt_epoch` completed epochs whose history is `ckpt_history`: ints in range, a stop reason that is a
    string or None, records of numbers no longer than the epochs completed, continuing the checkpoint's."""
    keys = {"completed_epochs", "target_epochs", "stop_reason", "stop_source", "records"}
    if not isinstance(data, Mapping) or set(data) != keys:
        found = got(data) if not isinstance(data, Mapping) else f"keys {sorted(map(str, data))}"
        return [f"it must be a dict of {sorted(keys)} (got {found})"]
    out: list[str] = []
    int_field(data["completed_epochs"], "completed_epochs", 0, MAX_COUNT, out)
    int_field(data["target_epochs"], "target_epochs", 0, MAX_COUNT, out)
    if data["stop_reason"] is not None and (not isinstance(data["stop_reason"], str)
                                            or len(data["stop_reason"]) > MAX_TEXT):
        out.append(f"stop_reason must be None or a string (got {got(data['stop_reason'])})")
    if not isinstance(data["stop_source"], str) or len(data["stop_source"]) > MAX_TEXT:
        out.append(f"stop_source must be a string (got {got(data['stop_source'])})")
    if out:
        return out
    done = data["completed_epochs"]
    records = data["records"]
    _history(records, done, "records", out)
    if out or not isinstance(ckpt_history, Mapping):
        return out
    # The record ends the run of the checkpoint: its records continue the checkpoint's by the epochs after it.
    extra = done - ckpt_epoch
    for stage, metrics in ckpt_history.items():
        if isinstance(metrics, Mapping) and VAL_POINT_KEY in metrics:
            continue  # one row per validation point, not per epoch
        for name, values in metrics.items() if isinstance(metrics, Mapping) else ():
            mine = records.get(stage, {}).get(name) if isinstance(records.get(stage), Mapping) else None
            if not isinstance(values, list) or len(values) != ckpt_epoch:
                continue  # a history that does not cover every epoch (started from an older file)
            if mine is None or len(mine) != len(values) + extra:
                out.append(f"records[{stage!r}][{name!r}] must hold {len(values) + extra} values (the checkpoint's"
                           f" {len(values)} and one per epoch after it, to the {done} completed) (got"
                           f" {got(mine) if mine is None else f'{len(mine)} values'})")
                return out
    return out


def progress_problems(data) -> list[str]:
    """Every way a progress record (`progress.pt`) breaks its rule: `{'completed_epochs': int in range}`."""
    if not isinstance(data, Mapping) or set(data) != {"completed_epochs"}:
        return [f"it must be a dict of 'completed_epochs' (got {got(data)})"]
    out: list[str] = []
    int_field(data["completed_epochs"], "completed_epochs", 0, MAX_COUNT, out)
    return out
