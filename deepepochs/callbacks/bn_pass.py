"""`SWACallback`'s BatchNorm pass: which data it reads, and reading it so that a resume reads the same.

torch's `update_bn` recomputes the averaged model's BatchNorm statistics from scratch (a cumulative average
over the batches it is given), so the statistics depend on the averaged weights and on the batches alone:
the same batches in the same order give the same statistics, bit for bit. The pass is the spec's
`fit_statistics` state (`deepepochs.engine.statistics_pass` drives it): a listed signal during it stops the
fit at the last epoch's end, and the resumed run reads the same batches again, because

- the data is re-iterable and ends: `bn_data` when given, else the training DataLoaders as given, which
  must have a length and draw without replacement (an endless or resampled stream, a one-shot iterator or
  data without a length needs `bn_data`, or `bn_batches` to bound the pass over a DataLoader);
- the pass leaves every generator it may draw from as it found it (Python's, NumPy's, torch's, and the
  DataLoaders' own), so it starts from the generator states of the fit's end, which every snapshot of the
  fit's end holds, and a later fit draws what it would have drawn without the pass.
"""

from __future__ import annotations

import collections.abc
import itertools

import torch
from torch.optim.swa_utils import update_bn
from torch.utils.data import DataLoader, RandomSampler, WeightedRandomSampler

from deepepochs.data.sampling import user_generators
from deepepochs.engine.stage_tasks import data_length
from deepepochs.engine.update_clock import endless
from deepepochs.errors import ConfigError
from deepepochs.utils import rng_state, set_rng_state

__all__ = ["check_bn_data", "has_batch_norm", "no_end", "recompute", "refuse_training_data"]

_WAYS_OUT = "pass bn_data=<a DataLoader that ends> (bn_batches=N bounds the pass to N batches), or bn_update=False"


def has_batch_norm(model: torch.nn.Module) -> bool:
    """Whether `model` holds BatchNorm layers, whose statistics the pass recomputes."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())  # noqa: SLF001


def _one_shot(data) -> bool:
    """An iterator (a generator, `iter(loader)`): it is used up by one reading."""
    return isinstance(data, collections.abc.Iterator)


def no_end(data) -> str | None:
    """Why `data` (re-iterable) may never end, or None: it is known to be endless, it draws its samples with
    replacement (a resampled stream, whose length is a number the user chose), or it has no length."""
    why = endless(data)
    if why is not None:
        return f"an endless stream ({why})"
    sampler = getattr(data, "sampler", None)
    if isinstance(sampler, (RandomSampler, WeightedRandomSampler)) and sampler.replacement:
        return f"a stream drawn with replacement ({type(sampler).__name__}(replacement=True))"
    if data_length(data) is None:
        return f"data without a length ({type(data).__name__})"
    return None


def check_bn_data(bn_data, bn_batches) -> None:
    """Refuse a `bn_data` the pass cannot read again on a resume (a one-shot iterator) or cannot end on (an
    endless or length-less source without `bn_batches`)."""
    if bn_data is None:
        return
    if _one_shot(bn_data) or not isinstance(bn_data, collections.abc.Iterable):
        what = "a one-shot iterator, used up by one pass" if _one_shot(bn_data) else "not iterable"
        raise ConfigError(f"SWACallback bn_data must be a re-iterable such as a DataLoader or a list of batches,"
                          f" which a resumed run reads again (got {type(bn_data).__name__}: {what})")
    why = no_end(bn_data)
    if why is not None and bn_batches is None:
        raise ConfigError(f"SWACallback bn_data is {why}: the BatchNorm pass would not end; pass bn_batches=N to"
                          " read its first N batches, or bn_data that ends")


def refuse_training_data(loaders: list, bn_batches: int | None) -> None:
    """At the fit's start, with no `bn_data`: refuse training data the pass cannot read as a whole again
    (a one-shot iterator, anything but a DataLoader), or cannot end on (an endless or resampled stream, a
    DataLoader without a length) unless `bn_batches` bounds it."""
    for index, data in enumerate(loaders):
        if _one_shot(data) or not isinstance(data, DataLoader):
            kind = "a one-shot iterator" if _one_shot(data) else "not a DataLoader"
            raise ConfigError(
                f"SWACallback's BatchNorm pass (bn_update=True) reads the training data again at the fit's end,"
                f" but the train data of task {index} is {kind} (got {type(data).__name__}), which a resumed run"
                f" could not read as this one did; {_WAYS_OUT}")
        why = no_end(data)
        if why is not None and bn_batches is None:
            raise ConfigError(
                f"SWACallback's BatchNorm pass (bn_update=True) reads the training data again at the fit's end,"
                f" but the train data of task {index} is {why}, so the pass would not end; {_WAYS_OUT}")


def recompute(averaged: torch.nn.Module, sources: list, bn_batches: int | None, read, device) -> None:
    """torch's `update_bn` on `averaged` over the batches of `sources` one after the other (at most
    `bn_batches` in all), each fetched through `read` (the engine's guard: it stops at a listed signal),
    every generator the data may draw from left as it was."""
    generators = [g for data in sources for g in user_generators(data)]
    states = rng_state(), [g.get_state() for g in generators]
    batches = itertools.chain.from_iterable(sources)
    if bn_batches is not None:
        batches = itertools.islice(batches, bn_batches)
    try:
        update_bn(read(batches), averaged, device=device)
    finally:
        set_rng_state(states[0])
        for generator, state in zip(generators, states[1]):
            generator.set_state(state)
