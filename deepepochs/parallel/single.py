"""The policy of an ordinary run, and what every policy shares.

- `PolicyBase`: the training order's seed, the samplers whose epoch a policy sets, the generators and
  stateful datasets of the training data a checkpoint keeps, and the model-facing methods of policies
  that keep whole tensors (`deepepochs.parallel.ddp.DDPPolicy` builds on it; `deepepochs.parallel.fsdp`
  replaces the model-facing ones).
- `SingleProcess`: one process, nothing to synchronise. Every method is a cheap no-op or identity, so the
  trainer calls them unconditionally and the per-batch path has no `if distributed` branches.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping

import torch

from deepepochs.data.batch_rules import stateful
from deepepochs.data.sampling import own_order, shard, user_generators
from deepepochs.data.streams import epoch_stream
from deepepochs.errors import DistributedError

__all__ = ["PolicyBase", "SingleProcess"]


class PolicyBase:
    """What every policy shares: the training order's seed (`DataOrder`; None until the first training
    DataLoader is prepared, or restored from a checkpoint) and the samplers whose epoch they set (weakly,
    so DataLoaders of finished fits can be collected); and, for policies that keep whole tensors (one
    process, DDP), the model-facing methods `FSDPPolicy` (`deepepochs.parallel.fsdp`) replaces."""

    #: Whether the model is sharded (FSDP): then any forward and any whole-gradient read is a collective
    #: every rank must join (callbacks that read the model on rank 0 alone check it).
    shards_model = False
    #: The training order of a plain DataLoader (`Trainer(data_order=...)`): 'global', the (seed, epoch)
    #: order of `DataOrder` every world size shares; one process may train on the DataLoader's own ('loader').
    data_order = "global"

    def __init__(self):
        self.order_seed: int | None = None
        self._epoch_samplers: weakref.WeakSet = weakref.WeakSet()
        # The generators of the user's own training DataLoaders (data_order='loader'), in the order first met,
        # and the states a loaded checkpoint holds for generators not met yet (the next fit's loaders).
        self._loader_generators: list[torch.Generator] = []
        self._pending_generator_states: list = []
        # Likewise the stateful datasets the training data streams from in this process (`streams.epoch_stream`):
        # the state the next epoch starts from, which every checkpoint keeps.
        self._streams: list = []
        self._pending_stream_states: list = []

    def loader_generator_states(self) -> list:
        """The states of the generators the training DataLoaders of this process draw from in their own
        order (a DataLoader's or its sampler's `generator`: data_order='loader', or a stateful DataLoader),
        in the order first met: a checkpoint
        keeps them beside torch's, so a resumed run's later epochs draw what the uninterrupted run drew."""
        return [generator.get_state() for generator in self._loader_generators]

    def continue_loader_generators(self, states: list) -> None:
        """Put back `loader_generator_states()` of a checkpoint: into the generators met already, and into
        those the next training DataLoaders bring, in the same order."""
        met = self._loader_generators
        for generator, state in zip(met, states):
            generator.set_state(state)
        self._pending_generator_states = list(states[len(met):])

    def stream_states(self) -> list:
        """The `state_dict()` of each stateful dataset the training data of this process streams from
        (`deepepochs.data.streams.epoch_stream`), in the order first met: a checkpoint keeps them, so that a
        resumed run's next epoch streams what the uninterrupted run's did."""
        return [stream.state_dict() for stream in self._streams]

    def continue_streams(self, states: list) -> None:
        """Put back `stream_states()` of a checkpoint: into the datasets met already, and into those the next
        training data brings, in the same order."""
        met = self._streams
        for stream, state in zip(met, states):
            stream.load_state_dict(state)
        self._pending_stream_states = list(states[len(met):])

    def _own_order(self, dataloader):
        """A training DataLoader in its own order (`sampling.own_order`: one process's default, and any
        sampler without a global order, such as one drawing with replacement), or as given; the
        generators it draws from are met (their states travel in checkpoints), a stateful loader's too."""
        own = None if stateful(dataloader) else own_order(dataloader)
        data = dataloader if own is None else own
        self._meet_generators(user_generators(data))
        stream = epoch_stream(data)
        if stream is not None and not any(stream is known for known in self._streams):
            self._streams.append(stream)
            if self._pending_stream_states:
                stream.load_state_dict(self._pending_stream_states.pop(0))
        return data

    def _meet_generators(self, generators) -> None:
        for generator in generators:
            if not any(generator is known for known in self._loader_generators):
                self._loader_generators.append(generator)
                if self._pending_generator_states:
                    generator.set_state(self._pending_generator_states.pop(0))

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the training samplers: a new permutation each epoch, the same on every rank."""
        for sampler in list(self._epoch_samplers):
            sampler.set_epoch(epoch)

    def shard_model(self, model: torch.nn.Module, optimizers) -> None:
        """Shard `model` and point `optimizers` at its shards (FSDP); whole tensors need nothing."""

    def drop_unsynced_gradients(self) -> None:
        """Rollback: drop gradients kept outside the parameters' `.grad` (FSDP); none here."""

    def local_shards(self, tensors: list) -> list:
        """This rank's part of each tensor: the tensors themselves when nothing is sharded."""
        return tensors

    def pad_eval(self, data):
        """The evaluation batches to run: `data` as it is (FSDP adds `PaddingBatch`es)."""
        return data

    def sync_eval_buffers(self, model: torch.nn.Module) -> None:
        """At an evaluation task's start: make the buffers every rank evaluates the model's that a checkpoint
        saves (DDP: rank 0's); one process has nothing to make equal."""

    # The checkpoint code loads states only through these (FSDP loads full states into shards).
    def load_model_state_dict(self, model: torch.nn.Module, state: Mapping) -> None:
        """Load a full model state (strict)."""
        model.load_state_dict(state)

    def load_optimizer_state_dict(self, model: torch.nn.Module, opt: torch.optim.Optimizer, state: Mapping) -> None:
        """Load a full optimizer state keyed by parameter index."""
        opt.load_state_dict(state)


class SingleProcess(PolicyBase):
    """One process: nothing to synchronise."""

    world_size = 1
    rank = 0
    local_rank = 0
    is_main = True

    def __init__(self, device: torch.device, split_batches: bool = False, data_order: str = "loader"):
        super().__init__()
        self.device = device
        self.model = None
        self.data_order = data_order

    def wrap_model(self, model: torch.nn.Module, ddp_kwargs: Mapping | None = None) -> torch.nn.Module:
        """The module the step calls (DDP wraps it; one process uses it as is, `ddp_kwargs` unused)."""
        self.model = model
        return model

    def prepare_dataloader(self, dataloader, stage: str):
        """The iterable a task iterates: a training DataLoader over one of torch's samplers keeps its own
        order, rebuilt around its sampler so that a resumed epoch draws it again and skips at the sampler
        (`LoaderOrder`, the default 'loader'), or a plain one gets the global order of (seed, epoch)
        (`DataOrder`, as under DDP with one rank: 'global'; a sampler with replacement, `num_samples`,
        weights or a subset has no global order and keeps its own); everything else is used as given."""
        if stage != "train":
            return dataloader
        if self.order_seed is None:  # kept for 'global' in any case: a checkpoint carries it to any world size
            self.order_seed = torch.initial_seed() % 2**62
        if self.data_order == "global":
            sharded = shard(dataloader, stage, 0, 1, False, self)
            if sharded is not None:
                self._epoch_samplers.add(sharded.sampler)
                return sharded
        return self._own_order(dataloader)

    def set_grad_sync(self, enabled: bool) -> None:
        """Whether the next backward all-reduces gradients (DDP's no_sync when False)."""

    def global_sum(self, value: int) -> int:
        """Sum of an int over all ranks."""
        return value

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of a tensor over all ranks."""
        return tensor

    def sync_patch(self, patch):
        """A metric patch merged over all ranks."""
        return patch

    def sync_patches(self, patches: dict) -> dict:
        """`{name: patch}` merged over all ranks, in a rank-independent name order."""
        return patches

    def broadcast_model(self, model: torch.nn.Module) -> None:
        """Make every rank's parameters and buffers equal to rank 0's."""

    def broadcast_object(self, obj):
        """Rank 0's value of a picklable object (e.g. the running id), on every rank."""
        return obj

    def all_gather_object(self, obj) -> list:
        """Every rank's value of a picklable object, in rank order, on every rank."""
        return [obj]

    def check_batch_counts(self, count: int, stage: str) -> None:
        """Raise if ranks ran different numbers of training batches (a hang otherwise)."""

    def main_process_first(self):
        """Context: the main process runs the block first, the others after it."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Release what this policy created (process groups it initialised)."""

    def publish_places(self, read_place) -> None:
        """Publish this rank's place (`read_place()`) for its peers to read; one process has no peers."""

    def agree_paths(self, place: dict) -> None:
        """Wait for the peers at this point of the loop and compare their paths; one process has no peers."""

    def timed_out(self, exc: BaseException, where: str, place: dict | None = None) -> DistributedError | None:
        """The `DistributedError` a collective's failure `exc` stands for; never one in one process."""
        return None
