"""The rules of the run-state fields a mid-epoch snapshot stores as they are.

A snapshot keeps, per rank, the run state's fields no other part of the file holds
(`deepepochs.engine.runstate.generic_fields`, encoded by `deepepochs.engine.position`: a tuple as
`{'__tuple__': [...]}`, a dict as `{'__dict__': {...}}`, an attrs record as `{'__attrs__': 'module:Class',
'fields': {...}}`). A resume writes them into the run state as they are and the fit then uses them: the
gradients an optimizer that did not step kept, the generator states a DataLoader drew its order from, the
model's buffers at the commit point. So each field has its rule here (`RULES`, one per generic field: a
test checks that none lacks one), checked with the rest of the file before anything is applied
(`deepepochs.checkpoint.field_rules`); a field this version's run state does not have is ignored by the
restore and not checked.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deepepochs.checkpoint.value_rules import MAX_COUNT, got, int_field

__all__ = ["RULES", "carried_state", "generator_state", "run_problems"]

#: The sizes a generator's state may have: the CPU generator's (Mersenne Twister) and an accelerator's
#: (Philox: seed and offset).
_GENERATOR_SIZES = (torch.get_rng_state().numel(), 16)


def run_problems(trainer, run, field: str, out: list) -> None:
    """Every way a rank's stored run-state fields (`run`, at `field`) break their rules against `trainer`."""
    if run is None:
        return
    if not isinstance(run, Mapping) or not all(isinstance(k, str) for k in run):
        out.append(f"{field} must be a dict of run-state fields by name (got {got(run)})")
        return
    for name, value in run.items():
        rule = RULES.get(name)
        if rule is not None and value is not None:
            rule(trainer, value, f"{field}[{name!r}]", out)


def generator_state(value, field: str, out: list) -> None:
    """A torch generator's state: a 1-d uint8 tensor of a CPU or accelerator generator's size."""
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1
            and value.numel() in _GENERATOR_SIZES):
        out.append(f"{field} must be a generator state, a 1-d uint8 tensor of {' or '.join(map(str, _GENERATOR_SIZES))}"
                   f" bytes (got {got(value)})")


def _encoded(value, tag: str, kind: type, field: str, out: list):
    """The contents of an encoded tuple or dict (`{tag: contents}`), or None (a problem recorded)."""
    if not isinstance(value, Mapping) or set(value) != {tag} or not isinstance(value[tag], kind):
        out.append(f"{field} must be an encoded {'tuple' if tag == '__tuple__' else 'dict'} {{{tag!r}: ...}}"
                   f" (got {got(value)})")
        return None
    return value[tag]


def _data_generators(trainer, value, field: str, out: list) -> None:
    """(epoch, task index, [the states of a stateful DataLoader's generators])."""
    items = _encoded(value, "__tuple__", list, field, out)
    if items is None:
        return
    if len(items) != 3 or not isinstance(items[2], list):
        out.append(f"{field} must hold (epoch, task index, list of generator states) (got {got(items)})")
        return
    int_field(items[0], f"{field}[0]", 1, MAX_COUNT, out)
    int_field(items[1], f"{field}[1]", 0, 1 << 16, out)
    for i, state in enumerate(items[2]):
        generator_state(state, f"{field}[2][{i}]", out)


def _order_draws(trainer, value, field: str, out: list) -> None:
    """`deepepochs.data.sampling.OrderDraws`: the epoch and task, and the generator states (or None) the
    DataLoader and its sampler drew the epoch's order from, and those of the other generators the epoch's
    data draws from (`generators`, a list, or None)."""
    names = {"epoch", "task_index", "loader", "sampler", "generators"}
    if not (isinstance(value, Mapping) and set(value) == {"__attrs__", "fields"}
            and isinstance(value["__attrs__"], str) and value["__attrs__"].endswith(":OrderDraws")
            and isinstance(value["fields"], Mapping) and set(value["fields"]) == names):
        out.append(f"{field} must be an OrderDraws record with the fields {sorted(names)} (got {got(value)})")
        return
    fields = value["fields"]
    int_field(fields["epoch"], f"{field}['epoch']", 1, MAX_COUNT, out)
    int_field(fields["task_index"], f"{field}['task_index']", 0, 1 << 16, out)
    for key in ("loader", "sampler"):
        if fields[key] is not None:
            generator_state(fields[key], f"{field}[{key!r}]", out)
    states = fields["generators"]
    if states is not None and not isinstance(states, list):
        out.append(f"{field}['generators'] must be None or a list of generator states (got {got(states)})")
    elif states is not None:
        for i, state in enumerate(states):
            generator_state(state, f"{field}['generators'][{i}]", out)


def _data_ended(trainer, value, field: str, out: list) -> None:
    """(epoch, task index, batches): where the training data's stream said it ended."""
    items = _encoded(value, "__tuple__", list, field, out)
    if items is None:
        return
    if len(items) != 3:
        out.append(f"{field} must hold (epoch, task index, batches) (got {got(items)})")
        return
    int_field(items[0], f"{field}[0]", 1, MAX_COUNT, out)
    int_field(items[1], f"{field}[1]", 0, 1 << 16, out)
    int_field(items[2], f"{field}[2]", 0, MAX_COUNT, out)


def _loader_starts(trainer, value, field: str, out: list) -> None:
    """Per stage and task (`"val/0"`), where its persistent DataLoader first made an iterator: (1-based epoch,
    updates, base seed)."""
    entries = _encoded(value, "__dict__", Mapping, field, out)
    for key, start in (entries or {}).items():
        items = _encoded(start, "__tuple__", list, f"{field}[{key!r}]", out)
        if items is None:
            continue
        if len(items) != 3 or not all(isinstance(item, int) for item in items):
            out.append(f"{field}[{key!r}] must hold (epoch, updates, base seed), three ints (got {got(items)})")
            continue
        int_field(items[0], f"{field}[{key!r}][0]", 0, MAX_COUNT, out)
        int_field(items[1], f"{field}[{key!r}][1]", 0, MAX_COUNT, out)


def carried_state(value, field: str, out: list) -> None:
    """One rank's entry of a file's `carried` (what the steps carry across batches, `trainer.carried`): an
    encoded dict by name. Its values are the user's own (hidden states, queues), so only the dict itself
    has a rule. (Not a snapshot's run-state field: every file holds it, checked by `field_rules`.)"""
    _encoded(value, "__dict__", Mapping, field, out)


def _tensors_like(saved, live: dict, what: str, field: str, out: list, finite: bool = False) -> None:
    """An encoded dict of tensors, each named as one of `live` (`what` names those) and of its shape and
    floating or not as it is; with `finite`, holding no inf or NaN."""
    entries = _encoded(saved, "__dict__", Mapping, field, out)
    if entries is None:
        return
    for name, tensor in entries.items():
        mine = live.get(name)
        if mine is None:
            out.append(f"{field}[{name!r}] names no {what} of this trainer")
        elif not isinstance(tensor, torch.Tensor) or tensor.shape != mine.shape \
                or tensor.is_floating_point() != mine.is_floating_point():
            out.append(f"{field}[{name!r}] must be a tensor of shape {tuple(mine.shape)}, {mine.dtype} like the"
                       f" {what} (got {got(tensor)})")
            return
        elif finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            out.append(f"{field}[{name!r}] must be finite: this trainer raises on a non-finite gradient"
                       f" (nonfinite='raise') (got {got(tensor)} holding inf or NaN)")
            return


def _buffers(trainer, value, field: str, out: list) -> None:
    """The model's buffers by name, as `named_buffers()` gives them."""
    _tensors_like(value, dict(trainer.raw_model.named_buffers()), "model buffer", field, out)


def _grads(trainer, value, field: str, out: list) -> None:
    """The gradients kept for the optimizers' parameters, by `"<optimizer>.<group>.<position>"`: finite where
    a non-finite one would make the next update raise."""
    params = {f"{i}.{g}.{j}": p for i, item in enumerate(trainer.opt.items)
              for g, group in enumerate(item.opt.param_groups) for j, p in enumerate(group["params"])}
    config = trainer.config  # fp16's scaler, or nonfinite='skip', skips the update such gradients reach
    finite = config.nonfinite == "raise" and config.precision != "fp16"
    _tensors_like(value, params, "optimizer parameter", field, out, finite)


#: The rule of each run-state field a snapshot stores as it is: (trainer, value, field, problems).
RULES = {"data_generators": _data_generators, "data_ended": _data_ended, "order_draws": _order_draws,
         "buffers": _buffers, "grads": _grads, "loader_starts": _loader_starts}
