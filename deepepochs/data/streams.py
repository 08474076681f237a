"""What decides the rest of a training data stream, besides torch's global generator: the generators its
iterators draw from and the state of data that follows the `state_dict()` / `load_state_dict()` protocol.

- `stream_holder`: the object whose `state_dict()` a commit point keeps (a mid-epoch snapshot's data state):
  torchdata's `StatefulDataLoader`, a stateful `IterableDataset` loaded in the main process, a stateful
  iterable of batches.
- `epoch_stream`: the stateful dataset whose state the next epoch starts from (every checkpoint keeps it).
- `start_draws`: the states of the generators a training task's data draws its epoch from, kept when the task
  first makes its iterator (`sampling.OrderDraws`) and put back when a refit or a resume makes it again.
- `resume_warning`, `inexact_reason`: why data iterated past its trained batches may continue in another
  order, and what the user can do about it.

The one-process order of a DataLoader over torch's samplers (`sampling.LoaderOrder`) draws its epoch from the
same record; this module extends it to any other data.
"""

from __future__ import annotations

import random

import attrs
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

from deepepochs.data.sampling import OrderDraws, ShortestShard, loader_order, user_generators

__all__ = ["StreamSource", "epoch_stream", "generators_of", "has_state", "inexact_reason", "resume_warning",
           "start_draws", "stream_holder"]


@attrs.define(slots=True, eq=False)
class StreamSource:
    """A running training task's stateful data: `holder` (`stream_holder`), whose `state_dict()` each commit
    point keeps, and the generators its iterators draw from (`sampling.user_generators` of the task's data),
    whose states each commit point keeps beside it. `ended`: the task's iterator said it has no more batches
    (read ahead to find the task's last one); the holder's state may then already be the next pass's, so a
    commit point records that the task is over (`RunState.data_ended`)."""

    holder: object
    generators: list
    ended: bool = False

    def watch(self, batches):
        """`batches` (the task's iterator), noting its end in `ended`."""
        yield from batches
        self.ended = True


def has_state(obj) -> bool:
    """Whether `obj` follows the `state_dict()` / `load_state_dict(state)` protocol (torchdata's `Stateful`)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _unwrap(data):
    """The rank's own data under a `ShortestShard` (DDP, data without a length)."""
    return data.data if isinstance(data, ShortestShard) else data


def stream_holder(data):
    """What a commit point keeps the `state_dict()` of, so that a refit or a resumed snapshot continues the
    task's stream after its committed batches (`load_state_dict`) instead of iterating past them: a stateful
    DataLoader (torchdata's `StatefulDataLoader`, which gathers its workers' states), a stateful
    `IterableDataset` in a DataLoader without workers (its state is the main process's), or a stateful
    iterable of batches given as it is; None for anything else."""
    data = _unwrap(data)
    if isinstance(data, DataLoader):
        if has_state(data):
            return data
        return epoch_stream(data)
    return data if has_state(data) else None


def epoch_stream(data):
    """The stateful dataset in this process whose state the next epoch's iteration starts from: an
    `IterableDataset` with `state_dict()` / `load_state_dict()` loaded without workers (by a DataLoader or
    torchdata's), or a stateful iterable of batches; None otherwise (with workers, each epoch starts from
    the dataset as this process holds it, which never moves)."""
    data = _unwrap(data)
    if not isinstance(data, DataLoader):
        return data if has_state(data) and not isinstance(data, (list, tuple)) else None
    dataset = data.dataset
    if isinstance(dataset, IterableDataset) and has_state(dataset) and not data.num_workers:
        return dataset
    return None


def _sampler_of(data):
    """The sampler a DataLoader draws its indices from: a `batch_sampler=`'s own sampler (None when it has
    none: the batch sampler is the order), else `sampler`."""
    batch_sampler = getattr(data, "batch_sampler", None)
    if batch_sampler is not None and getattr(data, "batch_size", 0) is None:  # batch_sampler= was given
        return getattr(batch_sampler, "sampler", None)
    return getattr(data, "sampler", None)


def generators_of(data) -> list:
    """`sampling.user_generators` of a task's data (under a `ShortestShard`, of the rank's own data)."""
    return user_generators(_unwrap(data))


def start_draws(data, epoch: int, task_index: int, kept: OrderDraws | None) -> OrderDraws | None:
    """Call right before a training task makes its epoch's iterator of `data`. With `kept` of this epoch and
    task (a refit, or a resumed snapshot, of it) the generators `data` draws from go back to their states
    then, so that the iterator made again (and the batches iterated past, or loaded back by a stateful
    loader) draws what the first one drew; otherwise their states are kept now. Returns the record the run
    state holds (None for data drawing from no generator of its own)."""
    order = loader_order(data)
    if order is not None:
        return order.start(epoch, task_index, kept)
    generators = generators_of(data)
    if kept is not None and (kept.epoch, kept.task_index) == (epoch, task_index) and kept.generators is not None:
        for generator, state in zip(generators, kept.generators):
            generator.set_state(state)
        return kept
    if not generators:
        return None
    return OrderDraws(epoch, task_index, generators=[generator.get_state() for generator in generators])


_GENERATOR_TYPES = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)


def _hidden_generators(obj) -> list[str]:
    """The attributes of `obj` holding a random generator that no checkpoint keeps (all but `generator`)."""
    return [f"{name!r} (a {type(value).__module__}.{type(value).__name__})"
            for name, value in vars(obj).items() if name != "generator" and isinstance(value, _GENERATOR_TYPES)] \
        if hasattr(obj, "__dict__") else []


def resume_warning(data, count: int) -> str | None:
    """The warning for training data iterated past its first `count` batches to continue an epoch, naming
    what may differ and what to do (`inexact_reason`); None when it continues exactly."""
    reason = inexact_reason(data)
    if reason is None:
        return None
    return (f"resuming inside an epoch: the training data ({type(_unwrap(data)).__name__}) is not a plain DataLoader,"
            f" so its order may differ from the interrupted run's; its first {count} batches are iterated past, and"
            f" the rest of the epoch may repeat or miss samples. To resume exactly: {reason} (docs: Exact resume)")


def inexact_reason(data) -> str | None:
    """Why data continued by iterating past its trained batches may not continue the interrupted order, and
    what to do; None when its order is fixed or decided by what the run keeps (torch's generators and the
    generators it was given)."""
    data = _unwrap(data)
    if isinstance(data, (list, tuple)):
        return None
    stateful_hint = ("give it state_dict() and load_state_dict() returning and restoring what decides the rest of"
                     " its stream (torchdata's Stateful protocol)")
    if not isinstance(data, DataLoader):
        return (f"the training data ({type(data).__name__}) is neither a DataLoader nor stateful: {stateful_hint},"
                " or pass a DataLoader over torch's samplers")
    dataset = data.dataset
    if isinstance(dataset, IterableDataset):
        name = type(dataset).__name__
        if not has_state(dataset):
            return (f"its IterableDataset {name} has no state the run can keep: {stateful_hint}"
                    + (", and load it with torchdata's StatefulDataLoader, which collects that state from the"
                       " DataLoader's workers" if data.num_workers else ""))
        return (f"its IterableDataset {name} is stateful, but a DataLoader cannot read its state inside its"
                f" {data.num_workers} worker processes: load it with torchdata's StatefulDataLoader (it collects"
                " the workers' states), or with num_workers=0")
    sampler = _sampler_of(data)
    if isinstance(sampler, SequentialSampler):
        return None  # a fixed order
    hidden = [f"sampler {type(s).__name__}'s attribute {h}" for s in (sampler, getattr(data, "batch_sampler", None))
              if s is not None for h in _hidden_generators(s)]
    if hidden:
        return (f"the {'; the '.join(hidden)} is not saved: draw from a torch.Generator held as the sampler's"
                f" `generator` attribute (its state is kept), or {stateful_hint} and load the data with"
                " torchdata's StatefulDataLoader")
    custom = [s for s in (sampler, getattr(data, "batch_sampler", None))
              if s is not None and not type(s).__module__.startswith("torch.utils.data")]
    owner = type(custom[0] if custom else data).__name__
    return (f"its order comes from {owner}, whose state the run keeps only through the generators it draws from"
            " (a `generator` attribute, torch's global generator); if it holds other state,"
            f" {stateful_hint} and load the data with torchdata's StatefulDataLoader, or build it from torch's"
            " samplers (RandomSampler with replacement= and num_samples=, SubsetRandomSampler,"
            " WeightedRandomSampler, each with a generator)")
