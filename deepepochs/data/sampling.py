"""Where data goes in a run of several processes, and the training order in one process.

- `DataOrder`: the global training order of a plain DataLoader, a function of (seed, epoch), sharded by rank
  (several processes; one process with `data_order='global'`).
- `LoaderOrder`, `OrderDraws`: one process's default order (`data_order='loader'`), the DataLoader's own
  sampler drawing as it would in a plain loop, with what it drew kept so that a resumed epoch draws it again.
- `skip_batches`, `iterate_past`: continuing an epoch past its committed batches (at the sampler when the order
  is one of these two).
- `EvalShardSampler`: evaluation shards holding each sample exactly once.
- `ShortestShard`: training data without a length, ended on every rank at the shortest shard.
- `PaddingBatch`: a forward a rank runs only to meet the other ranks' collectives (FSDP evaluation).
- `shard`: a plain DataLoader rebuilt with these samplers (others are used as given).

The policies (`deepepochs.parallel.ddp`, `deepepochs.parallel.fsdp`) decide when to use them.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import warnings

import attrs
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from deepepochs.errors import ConfigError, DeepEpochsWarning

__all__ = ["RANDOM_SAMPLERS", "DataOrder", "EvalShardSampler", "LoaderOrder", "OrderDraws", "PaddingBatch",
           "ShortestShard",
           "is_plain", "iterate_past", "len_or_minus_one", "loader_order", "own_order", "shard", "skip_batches",
           "unsplit_warning", "user_generators"]


class PaddingBatch:
    """A batch a rank runs only so that its forward's collectives meet the other ranks' (FSDP evaluation,
    `deepepochs.parallel.fsdp`): the engine runs the model's forward on `batch` and records nothing of it."""

    __slots__ = ("batch",)

    def __init__(self, batch):
        self.batch = batch


class DataOrder(DistributedSampler):
    """The training order of a plain DataLoader, in one process and under DDP alike: a function of
    (seed, epoch) only, whatever the world size, then sharded across the ranks.

    It is `DistributedSampler`'s order: with `shuffle`, `torch.randperm(n, generator=torch.Generator().
    manual_seed(seed + epoch))`, else `range(n)`; padded by repeating its start to a multiple of the world
    size; rank r takes every w-th index from r. So w ranks with batch b see, batch by batch, the samples
    one process with batch w*b sees. The seed is the policy's `order_seed` (rank 0's `torch.
    initial_seed()` when the first training DataLoader was prepared; restored from checkpoints), read
    at each epoch; a DataLoader (or its `RandomSampler`) built with its own `generator` is ordered by that
    generator's seed instead. `skip` (set by `skip_batches`) drops this rank's first samples of the next epoch's
    iteration, so a resumed epoch never loads the batches it skips.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, shuffle: bool, policy, generator=None):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, drop_last=False)
        self.policy = policy
        self.skip = 0
        # A DataLoader given its own generator keeps ordering by it: its seed replaces the policy's.
        self.own_seed = None if generator is None else generator.initial_seed() % 2**62

    def __iter__(self):
        if self.own_seed is not None:
            self.seed = self.own_seed
        elif self.policy is not None and self.policy.order_seed is not None:
            self.seed = self.policy.order_seed
        skip, self.skip = self.skip, 0
        return _past(super().__iter__(), skip)


@attrs.define(slots=True, eq=False)
class OrderDraws:
    """What a training task's DataLoader drew its epoch's order from, in the loader's own order (one process,
    `data_order='loader'`): kept in the run state when the task first makes its epoch's iterator, so that a
    refit or a resumed snapshot of that epoch draws exactly the same order and worker seeds.

    Attributes:
        epoch: the 1-based epoch (the loop's count) the draws belong to.
        task_index: the training task (0-based).
        loader: the state of the DataLoader's own `generator` just before the epoch's iterator drew its base
            seed (the worker seeds); None when it has none (it draws from torch's global generator, which the
            run's random state at the task's start covers).
        sampler: the state of the generator the random sampler drew the epoch's first indices from (its own,
            or torch's global CPU generator) just before it drew; None for a sequential order, or before
            the sampler drew.
        generators: for other data (not in `LoaderOrder`), the states of the generators it draws from
            (`user_generators`: a stateful loader's, a sampler's of the user's own) just before the task made
            its iterator (`deepepochs.data.streams.start_draws`); None in the loader's own order.
    """

    epoch: int
    task_index: int
    loader: torch.Tensor | None = None
    sampler: torch.Tensor | None = None
    generators: list | None = None


#: torch's samplers that draw at random: from their `generator`, or from torch's global generator when it is
#: None (`RandomSampler` then draws its own generator's seed from it), from their first index on. What one
#: epoch of them yields is decided by those generators' states when it starts, so a resumed epoch that
#: starts them there again draws the same indices (`LoaderOrder`).
RANDOM_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
#: The samplers a DataLoader in its own order may hold (`own_order`): the random ones and the sequential one.
_OWN_SAMPLERS = (SequentialSampler, *RANDOM_SAMPLERS)


class LoaderOrder(Sampler[int]):
    """A DataLoader's own sampler (the `SequentialSampler` or `RandomSampler` its `shuffle=` made, or one of
    torch's samplers the caller built: `RandomSampler` with or without replacement or `num_samples`,
    `SubsetRandomSampler`, `WeightedRandomSampler`; `RANDOM_SAMPLERS`), iterated as it is: one process
    trains on exactly the batches a plain loop over the DataLoader gets after the same seed, and every
    random draw (the indices, from the sampler's generator or torch's global one; the base seed of the
    iterator) happens where the plain loop's does.

    What a resumed epoch needs besides: `start` puts back (or keeps) the generators' states of the epoch's
    first iterator (`OrderDraws`), and `skip` (set by `skip_batches`) drops the next iteration's first
    samples, so skipped batches are never loaded.

    Args:
        sampler: the DataLoader's sampler.
        loader_generator: the DataLoader's own `generator` (its iterators' base seeds), or None.
    """

    def __init__(self, sampler, loader_generator=None):
        self.sampler = sampler
        self.loader_generator = loader_generator
        self.skip = 0
        self.draws: OrderDraws | None = None
        self._replay = None

    def __len__(self) -> int:
        return len(self.sampler)

    def start(self, epoch: int, task_index: int, kept: OrderDraws | None) -> OrderDraws:
        """Call right before the task makes its epoch's iterator. With `kept` of this epoch and task (a refit
        or a resume of it) the loader's generator goes back to its state then and the sampler will draw its
        permutation from the state it drew from; otherwise the loader's generator state is kept now and the
        sampler's when it draws. Returns the record, which the run state holds (it is filled in place)."""
        if kept is not None and (kept.epoch, kept.task_index) == (epoch, task_index):
            if kept.loader is not None and self.loader_generator is not None:
                self.loader_generator.set_state(kept.loader)
            self._replay = kept.sampler
            self.draws = kept
        else:
            generator = self.loader_generator
            self._replay = None
            self.draws = OrderDraws(epoch, task_index, None if generator is None else generator.get_state())
        return self.draws

    def __iter__(self):
        # Called where a plain loop's DataLoader iterator first asks its sampler (BatchSampler's first
        # batch): the sampler's first draw (a permutation, a seed, a first chunk of indices drawn with
        # replacement) is made here, at once, so that it is where the plain loop's is. Its later draws (the
        # next chunks, from its own generator) follow as it is iterated: the skipped samples' included, so
        # that the generator stands where the uninterrupted run's did after them.
        skip, self.skip = self.skip, 0
        replay, self._replay = self._replay, None
        if not isinstance(self.sampler, RANDOM_SAMPLERS):
            return _past(iter(self.sampler), skip)
        generator = self.sampler.generator  # None: the sampler draws from torch's global generator
        now = None
        if replay is not None:
            if generator is None:
                now = torch.get_rng_state()
                torch.set_rng_state(replay)
            else:
                generator.set_state(replay)
        if self.draws is not None:
            self.draws.sampler = torch.get_rng_state() if generator is None else generator.get_state()
        indices = iter(self.sampler)
        first = next(indices, _END)  # the RandomSampler draws its permutation now
        if now is not None and skip:
            # The task continues after committed batches: torch's generator is the commit point's again
            # (the iterator was made from the task's first states, `engine.continuation`).
            torch.set_rng_state(now)
        if first is _END:
            return iter(())
        return _past(itertools.chain((first,), indices), skip)


_END = object()


def _past(indices, skip: int):
    """The iterator `indices` past its first `skip` items: itself when none are skipped (an `islice` would
    cost a step per index of every batch)."""
    return itertools.islice(indices, skip, None) if skip else indices


def user_generators(data) -> list:
    """The generators a DataLoader was given or made for itself (its own `generator`, its sampler's, e.g.
    torchdata's stateful `RandomSampler`, its batch sampler's and that one's sampler's), then the `generator`
    of an `IterableDataset` without state it streams, each once, in that order: what its epochs' orders, base
    seeds and streamed samples draw from besides torch's global generator. (A stream's generator is kept so
    that an epoch started again, or iterated past its trained batches, streams its samples again; a
    map-style dataset's is not, since its trained batches are skipped at the sampler, never loaded.)"""
    sampler = getattr(data, "sampler", None)
    if isinstance(sampler, LoaderOrder):
        sampler = sampler.sampler
    batch_sampler = getattr(data, "batch_sampler", None)
    dataset = getattr(data, "dataset", None)
    stream = dataset if isinstance(dataset, IterableDataset) and not callable(getattr(dataset, "state_dict", None)) \
        else None
    found = []
    for generator in (getattr(data, "generator", None), getattr(sampler, "generator", None),
                      getattr(batch_sampler, "generator", None),
                      getattr(getattr(batch_sampler, "sampler", None), "generator", None),
                      getattr(stream, "generator", None)):
        if isinstance(generator, torch.Generator) and not any(generator is known for known in found):
            found.append(generator)
    return found


def loader_order(data) -> LoaderOrder | None:
    """The `LoaderOrder` of a DataLoader `own_order` made, else None."""
    sampler = getattr(data, "sampler", None)
    return sampler if isinstance(sampler, LoaderOrder) and isinstance(data, DataLoader) else None


def skip_batches(data, count: int, samples: int | None = None, world_size: int = 1):
    """`(data, how many batches are skipped, how many of them the caller iterates past)`.

    `count` batches of this rank, or with `samples` (a snapshot of another world size) the samples all
    ranks consumed: this rank's shard then skips `samples / world_size`. A DataLoader in one of our orders
    (`DataOrder`, `LoaderOrder`) skips at the sampler (the skipped samples are never loaded: none to iterate
    past), or with worker processes is iterated past them (the workers' random streams then continue as in
    the uninterrupted run); anything else is iterated past
    `count` batches by the caller (`iterate_past`), which continues the interrupted order when the order is
    fixed or drawn from generators the run keeps (`deepepochs.data.streams.resume_warning` says when not)."""
    sampler = getattr(data, "sampler", None)
    if isinstance(sampler, (DataOrder, LoaderOrder)) and isinstance(data, DataLoader):
        batch = data.batch_size or 1
        if samples is None and data.num_workers:
            # Worker processes draw their random numbers (augmentation) in the order they load samples:
            # they load the skipped batches again, so the batches after them get the uninterrupted draws.
            return data, count, count
        if samples is None:
            sampler.skip = count * batch
            return data, count, 0
        per_rank, extra = divmod(samples, world_size)
        count, partial = divmod(per_rank, batch)
        if extra or partial:
            warnings.warn(f"resuming a snapshot of another world size: the {samples} samples the epoch consumed are"
                          f" not a whole number of this run's global batches ({world_size} x {batch}); it"
                          f" continues after {count * batch * world_size} of them (keep world size x batch size"
                          " equal to resume exactly)", DeepEpochsWarning, stacklevel=2)
        sampler.skip = count * batch
        return data, count, 0
    return data, count, count


def iterate_past(iterator, count: int):
    """`iterator` after reading (and dropping) its next `count` items, now rather than at its first use."""
    collections.deque(itertools.islice(iterator, count), maxlen=0)
    return iterator


class EvalShardSampler(Sampler[int]):
    """Rank `rank` of `world_size` gets indices `rank, rank + world_size, ...` of `range(num_samples)`.

    Over all ranks every index appears exactly once: no padding, so shards may differ in length by one.
    Used for validation and test data, where a padded duplicate would be counted twice in a metric.
    """

    def __init__(self, num_samples: int, rank: int, world_size: int):
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size

    def __iter__(self):
        return iter(range(self.rank, self.num_samples, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))


class ShortestShard:
    """Training data without a length under DDP: before each batch every rank says whether it has one, and
    the epoch ends for all ranks when any has none (the shortest shard). A longer shard's remaining batches
    are not used that epoch (warned once on that rank). Costs one small all-reduce per batch, for such
    data only; the alternative, shadowing the missing ranks' collectives (`torch.distributed.algorithms.
    Join`), would train the longer shards on gradients averaged over fewer ranks.

    Args:
        data: the rank's iterable (iterated anew each epoch).
        policy: the `DDPPolicy` whose group agrees.
    """

    def __init__(self, data, policy):
        self.data = data
        self.policy = policy
        self.warned = False

    def __iter__(self):
        batches = iter(self.data)
        used = 0
        while True:
            try:
                batch, have = next(batches), True
            except StopIteration:
                batch, have = None, False
            if not self.policy.all_have(have):
                if have and not self.warned:
                    self.warned = True
                    warnings.warn(
                        f"rank {self.policy.rank}: the training epoch ended after {used} batches, where another"
                        " rank's data ran out (training data without a length under DDP stops at the shortest"
                        " shard); this rank's remaining batches were not used. Give every rank the same number"
                        " of batches, or pass a DataLoader over a map-style dataset (sharded evenly)",
                        DeepEpochsWarning, stacklevel=2)
                return
            used += 1
            yield batch


def len_or_minus_one(data) -> int:
    try:
        return len(data)
    except TypeError:
        return -1


def unsplit_warning(data, world_size: int) -> str | None:
    """What to say about training data that `shard` left as given (not a plain DataLoader): each of the
    `world_size` processes trains on all of it, unless the caller split it. None when a `DistributedSampler`
    shows the caller did (as the sampler or inside the batch sampler)."""
    samplers = (getattr(data, "sampler", None), getattr(getattr(data, "batch_sampler", None), "sampler", None))
    if any(isinstance(s, DistributedSampler) for s in samplers):
        return None
    return (f"training data is not split: the {type(data).__name__} given to fit() is not a DataLoader deepepochs"
            f" can shard, so each of the {world_size} processes trains on all of it as given. Pass a DataLoader"
            " built with batch_size= and shuffle= (deepepochs gives each process its own share), or shard it"
            " yourself (e.g. batches[rank::world_size], or a DistributedSampler); if each process was already"
            " given its own part, silence this with warnings.filterwarnings('ignore', 'training data is not"
            " split')")


def is_plain(dataloader) -> bool:
    """A DataLoader whose sampling the caller left to `DataLoader` itself (`shuffle=` and `batch_size=`)."""
    if type(dataloader) is not DataLoader or isinstance(dataloader.dataset, IterableDataset):
        return False
    sampler = dataloader.sampler
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:
            return False
    elif type(sampler) is not SequentialSampler:
        return False
    batch_sampler = dataloader.batch_sampler
    if dataloader.batch_size is None:
        return batch_sampler is None
    return type(batch_sampler) is BatchSampler and batch_sampler.sampler is sampler


_DATALOADER_PARAMETERS = frozenset(inspect.signature(DataLoader.__init__).parameters)
# Settings copied from the original DataLoader (those this torch version knows).
_COPIED = tuple(
    name
    for name in (
        "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
        "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order",
    )
    if name in _DATALOADER_PARAMETERS
)


def own_order(dataloader):
    """A training DataLoader rebuilt around its own sampler (`LoaderOrder`): the same batches, workers,
    generator and random draws; or None when `dataloader` is to be used as given.

    Which: the exact class `DataLoader` over a map-style dataset whose indices come from one of torch's
    samplers (`_OWN_SAMPLERS`: the one `shuffle=` made, or a `RandomSampler` with replacement or
    `num_samples`, a `SubsetRandomSampler`, a `WeightedRandomSampler` the caller built), given as
    `sampler=` or inside torch's `BatchSampler` given as `batch_sampler=` (rebuilt as the same
    `batch_size` and `drop_last`)."""
    if type(dataloader) is not DataLoader or isinstance(dataloader.dataset, IterableDataset):
        return None
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:  # no automatic batching (batch_size=None): one index a batch
        sampler, batch_size, drop_last = dataloader.sampler, None, False
    elif type(batch_sampler) is BatchSampler:
        sampler, batch_size, drop_last = batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last
    else:
        return None
    if type(sampler) not in _OWN_SAMPLERS:
        return None
    settings = {name: getattr(dataloader, name) for name in _COPIED}
    return DataLoader(dataloader.dataset, batch_size=batch_size, sampler=LoaderOrder(sampler, dataloader.generator),
                      drop_last=drop_last, **settings)


def shard(dataloader, stage: str, rank: int, world_size: int, split_batches: bool, policy=None):
    """The rebuilt, sharded DataLoader, or None when `dataloader` is to be used as given; `policy` holds
    the training order's seed (`DataOrder`)."""
    if not is_plain(dataloader):
        return None
    batch_size = dataloader.batch_size
    if split_batches:
        if batch_size is None or batch_size % world_size:
            raise ConfigError(
                f"split_batches=True divides each DataLoader's batch_size by the world size {world_size}, "
                f"so batch_size must be a multiple of it (got batch_size={batch_size}); use a batch size "
                f"divisible by {world_size}, or split_batches=False for a per-process batch size"
            )
        batch_size //= world_size
    dataset = dataloader.dataset
    if stage == "train":
        shuffle = isinstance(dataloader.sampler, RandomSampler)
        # drop_last=False: shards are padded (by repeating samples) to equal length, so every rank runs
        # the same number of batches; the DataLoader's own drop_last still drops short batches.
        # The order follows a generator the caller gave the DataLoader or its RandomSampler, if any.
        generator = dataloader.generator or getattr(dataloader.sampler, "generator", None)
        sampler = DataOrder(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, policy=policy,
                            generator=generator)
        drop_last = dataloader.drop_last
    else:
        sampler = EvalShardSampler(len(dataset), rank, world_size)
        drop_last = False
    settings = {name: getattr(dataloader, name) for name in _COPIED}
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **settings)
