"""Distributed policy: DDP wrapping, sharding, gradient sync and global reductions (the process group's
lifecycle: `deepepochs.parallel.process_group`).

The trainer holds one policy object and calls the same methods whatever the world size:

- `SingleProcess` (`deepepochs.parallel.single`) is the policy of an ordinary run: every method is a cheap
  no-op or identity, so the trainer calls them unconditionally and the per-batch path has no
  `if distributed` branches.
- `DDPPolicy` is chosen (`deepepochs.parallel.strategy.select_policy`) when the environment describes a job of
  several processes (`RANK`/`WORLD_SIZE`, as set by `torchrun` or `deepepochs.launch`) or a process group of
  several ranks is already initialised. It joins the group, wraps the model in `DistributedDataParallel`,
  shards plain DataLoaders and turns local counts, loss sums and metric patches into global ones.
- `FSDPPolicy` (`deepepochs.parallel.fsdp`, with `Trainer(strategy='fsdp')`) is `DDPPolicy` with the model sharded
  by FSDP2 instead of replicated; it replaces the model-facing methods (`shard_model`, `set_grad_sync`,
  the full-state methods checkpoints use, `pad_eval`) and adds its own collectives (see its module).

Which collectives run, and when (every rank must issue them in the same order):

- Trainer construction: `init_process_group` (unless a group exists), rank 0's running id, and DDP's own
  parameter broadcast.
- fit(), per training task: one `all_gather_object` (do the batch counts agree? rank 0's shuffle seed).
- First fit, after the `on_before_fit` hooks: parameters and buffers broadcast from rank 0.
- Each training micro-batch: DDP's buffer broadcast in forward; the gradient all-reduce only on the
  window's updating micro-batch.
- Each update: the window's global sample count (with accumulation) and the fp32 finite-loss flag.
- Training data without a length (an IterableDataset, a generator): before each batch, whether every rank
  still has one (`ShortestShard`).
- Start of each evaluation task (validation, test, prediction), with DDP's `broadcast_buffers` (the
  default) and a model with buffers: one broadcast of rank 0's buffers (`sync_eval_buffers`).
- End of each task: the batch-count check (training), the loss sums, one exchange per metric patch.

Evaluation runs on the unwrapped module and issues no collective per batch, so validation and test shards
of different lengths cannot deadlock. It evaluates rank 0's buffers (BatchNorm's running statistics) on
every rank, as a plain loop that evaluates through the DDP wrapper does: the model a checkpoint saves.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    DistributedSampler,
)

from deepepochs.data.sampling import ShortestShard, len_or_minus_one, shard, unsplit_warning
from deepepochs.errors import DeepEpochsWarning, DistributedError
from deepepochs.parallel.heartbeat import Heartbeat, read_places
from deepepochs.parallel.path_agreement import PathAgreement
from deepepochs.parallel.process_group import GroupUse, env_int
from deepepochs.parallel.single import PolicyBase
from deepepochs.parallel.stall_report import rank_entry, stall_error
from deepepochs.patches import TensorPatch, _map_tensors
from deepepochs.patches.selection import merge_on_root

__all__ = ["DDPPolicy", "broadcast_bytes", "is_dtensor"]

# Words in torch's error when a collective failed because a peer's connection ended (the peer died).
_PEER_GONE = ("connection closed", "connection reset", "closed by peer", "broken pipe", "connection refused")


class DDPPolicy(PolicyBase):
    """Several processes, one model replica each, gradients all-reduced by `DistributedDataParallel`.

    Args:
        device: the device the trainer resolved. On CUDA it is replaced by `cuda:<LOCAL_RANK>` (one GPU per
            process) and made the current CUDA device.
        split_batches: divide the batch size of the DataLoaders this policy shards by the world size.
        timeout: seconds a collective waits for the other ranks, when this policy creates the group
            (None in `timeout_s` when the group was there already: its creator chose).
    """

    def __init__(self, device: torch.device, split_batches: bool = False, timeout: float = 600):
        super().__init__()
        self.split_batches = split_batches
        self.device = self._local_device(device)
        if self.device.type == "cuda":
            # Before the group exists: NCCL binds each rank's communicator to the current device.
            torch.cuda.set_device(self.device)
        self._group = GroupUse("nccl" if self.device.type == "cuda" else "gloo", timeout,
                               before_release=self._drop_reducer)
        self.timeout_s = self._group.timeout_s
        self._closed = False
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else self.rank
        self.is_main = self.rank == 0
        self._nccl = dist.get_backend() == "nccl"
        self.model: DistributedDataParallel | None = None
        self._unsplit_said = False  # the warning about training data used as given: once per trainer
        self._heartbeat: Heartbeat | None = None  # this rank's place for its peers (`publish_places`)
        self._agreement: PathAgreement | None = None  # where the ranks compare their paths (`agree_paths`)

    @staticmethod
    def _local_device(device: torch.device) -> torch.device:
        """`cuda:<LOCAL_RANK>` for a CUDA run (one process per visible GPU); other devices unchanged."""
        if device.type != "cuda":
            return device
        if "LOCAL_RANK" in os.environ:
            index = env_int("LOCAL_RANK")
        elif device.index is not None:
            index = device.index
        else:
            index = (dist.get_rank() if dist.is_initialized() else 0) % torch.cuda.device_count()
        if index >= torch.cuda.device_count():
            raise DistributedError(
                f"LOCAL_RANK={index} but only {torch.cuda.device_count()} CUDA device(s) are visible; start "
                "at most one process per visible GPU (torchrun --nproc-per-node, launch num_processes) or "
                "choose the devices with CUDA_VISIBLE_DEVICES"
            )
        return torch.device("cuda", index)

    # ---- model ----
    def wrap_model(self, model: torch.nn.Module, ddp_kwargs: Mapping | None = None) -> DistributedDataParallel:
        """Wrap `model` in DDP with the user's `ddp_kwargs` (see `check_ddp_kwargs`); its constructor
        already broadcasts rank 0's parameters."""
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = DistributedDataParallel(model, device_ids=device_ids, **(ddp_kwargs or {}))
        return self.model

    def broadcast_model(self, model: torch.nn.Module) -> None:
        """Copy rank 0's parameters and buffers to every rank (after init callbacks changed them).

        A sharded parameter (a DTensor, FSDP) is left alone: each of its elements lives on one rank only,
        so there is nothing to make equal."""
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if not is_dtensor(tensor):
                    dist.broadcast(tensor.data, src=0)

    def sync_eval_buffers(self, model: torch.nn.Module) -> None:
        """At an evaluation task's start: rank 0's buffers into every rank's `model` (the unwrapped module),
        in place, in one broadcast; nothing when the DDP wrapper does not sync buffers
        (`ddp_kwargs={'broadcast_buffers': False}`: each rank keeps its own, as DDP does) or there are none.

        Why: after the last training forward each rank's BatchNorm running statistics are its own (DDP
        broadcasts rank 0's *before* each training forward, then every rank updates them with its own batch).
        A plain loop that evaluates through the wrapper gets rank 0's again at its first evaluation forward,
        so every rank evaluates the model rank 0 saves; evaluation here runs on the unwrapped module without
        a collective per batch, so the broadcast is made here, once per task, for the same result.

        Training stays bit-identical: the next training forward broadcasts rank 0's buffers anyway (the
        wrapper ran no forward since, so it still syncs), and no rank reads its own values in between. The
        commit-point copies (`deepepochs.engine.buffers`) hold whatever the model held at the commit, so a
        rollback or a snapshot taken before or after this call puts back values that the next training
        forward (or the re-run evaluation's broadcast) makes rank 0's again. Every rank enters every
        evaluation task (validation stages and points, test, predict), so the collectives stay in step.
        """
        ddp = self.model
        if not isinstance(ddp, DistributedDataParallel) or not ddp.broadcast_buffers:
            return
        ignored = getattr(ddp, "parameters_to_ignore", ())  # what DDP leaves out of its own broadcast
        tensors = [buffer for name, buffer in model.named_buffers() if name not in ignored]
        if tensors:
            broadcast_bytes(tensors, self._collective_device())

    def broadcast_object(self, obj):
        """Rank 0's value of a picklable object (e.g. the running id), on every rank."""
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def all_gather_object(self, obj) -> list:
        """Every rank's value of a picklable object, in rank order, on every rank."""
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def set_grad_sync(self, enabled: bool) -> None:
        """Enable or suspend DDP's gradient all-reduce for the next forward/backward.

        This is exactly what `DistributedDataParallel.no_sync()` toggles: with it off, DDP's forward does
        not prepare the reducer, backward leaves gradients local, and the next synchronising backward
        all-reduces the accumulated local gradients together. It must be set before the forward.
        """
        if self.model is not None:
            self.model.require_backward_grad_sync = enabled

    # ---- data ----
    def prepare_dataloader(self, dataloader, stage: str):
        """Shard a plain DataLoader; use anything else as given. Training data is checked for equal lengths.

        A plain DataLoader (exact class `DataLoader` over a map-style dataset, with the sampler that
        `shuffle=` chose and the batch sampler built from `batch_size`) is rebuilt with:

        - stage 'train': a `DistributedSampler` with the original shuffling and padded, equal-length shards,
          seeded by rank 0's `torch.initial_seed()`; its epoch is set by `set_epoch`;
        - stages 'val'/'test': an `EvalShardSampler` (each sample on exactly one rank, no padding,
          original order); the DataLoader's `drop_last` is not applied, so no sample is lost.

        With `split_batches` the rebuilt DataLoader's batch size is the original divided by the world size.
        A training DataLoader over another of torch's samplers (with replacement, `num_samples`, weights, a
        subset; or inside a `BatchSampler`) has no global order: each rank keeps its own, rebuilt around it
        (`LoaderOrder`) so that a resumed epoch draws it again. Other iterables (DataLoaders with a user
        sampler or batch sampler, DataLoader subclasses, iterable datasets, plain iterables) are used
        unchanged; a user `DistributedSampler` still gets `set_epoch`. Where deepepochs did not shard the
        training data, rank 0 warns once that it is trained whole unless a `DistributedSampler` shows the
        caller split it (`unsplit_warning`).

        For training this is a collective: all ranks compare their batch counts, because a rank with more
        training batches than another would wait forever in a gradient all-reduce. Where some rank's data
        has no length (an IterableDataset, a generator), the ranks agree before each batch whether all of
        them still have one (`ShortestShard`): the epoch ends for all at the shortest shard.
        """
        sharded = shard(dataloader, stage, self.rank, self.world_size, self.split_batches, self)
        data = dataloader if sharded is None else sharded
        if stage != "train":
            return data
        said = sharded is not None or not self.is_main or self._unsplit_said
        message = None if said else unsplit_warning(data, self.world_size)
        if message is not None:
            self._unsplit_said = True
            warnings.warn(message, DeepEpochsWarning, stacklevel=2)
        if sharded is None:  # no global order (a sampler with replacement, ...): each rank's own, resumable
            data = self._own_order(dataloader)
        sampler = getattr(data, "sampler", None)
        count = len_or_minus_one(data)
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, (count, torch.initial_seed() % 2**62))
        counts = [c for c, _ in gathered]
        if len(set(counts)) > 1 and -1 not in counts:
            per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
            raise DistributedError(
                f"the training data has a different number of batches on each rank ({per_rank}); under DDP "
                "every rank must run the same number of training batches, or a rank would wait forever in "
                "the gradient all-reduce of a batch the others never run. Pass a plain DataLoader (sharded "
                "into equal-length shards automatically) or give every rank the same number of batches"
            )
        if self.order_seed is None:
            self.order_seed = gathered[0][1]  # rank 0's: the same permutation on every rank, disjoint shards
        if isinstance(sampler, DistributedSampler):
            self._epoch_samplers.add(sampler)
        if -1 in counts:  # some rank cannot tell its length: agree batch by batch where the epoch ends
            return ShortestShard(data, self)
        return data

    def all_have(self, have: bool) -> bool:
        """Whether every rank has `have` (one small all-reduce and one host read)."""
        buffer = torch.tensor([int(have)], dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(buffer, op=dist.ReduceOp.MIN)
        return bool(buffer.item())

    def check_batch_counts(self, count: int, stage: str) -> None:
        """After a training task: raise `DistributedError` on every rank if ranks ran different counts.

        The up-front comparison in `prepare_dataloader` prevents the hang for data with a length; this
        catches iterables without one that still ended in step.
        """
        if stage != "train":
            return
        local = torch.tensor([count], dtype=torch.int64, device=self._collective_device())
        gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        counts = [int(c) for c in gathered]  # one host read per task
        if len(set(counts)) > 1:
            per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
            raise DistributedError(
                f"ranks ran different numbers of training batches in this task ({per_rank}); every rank "
                "must run the same number of training batches under DDP"
            )

    # ---- global values ----
    def _collective_device(self) -> torch.device:
        """NCCL moves only CUDA tensors; gloo works on CPU tensors."""
        return self.device if self._nccl else torch.device("cpu")

    def global_sum(self, value: int) -> int:
        """Sum of an int over all ranks (one small all-reduce and one host read)."""
        buffer = torch.tensor([value], dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(buffer)
        return int(buffer.item())

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over all ranks, returned on `tensor`'s device; `tensor` is left unchanged."""
        buffer = tensor.detach().to(self._collective_device(), copy=True)
        dist.all_reduce(buffer)
        return buffer.to(tensor.device)

    def sync_patch(self, patch):
        """A copy of `patch` holding the merge of every rank's patch (the input is left unchanged). A
        `TensorPatch` (with the generic `sync`) is computed on rank 0 from every rank's predictions and
        its value sent to all (`merge_on_root`): no rank but 0 receives the others' predictions."""
        if type(patch).sync is TensorPatch.sync and isinstance(patch, TensorPatch):
            return merge_on_root(patch, self.device)
        return patch.copy().sync()

    def sync_patches(self, patches: dict) -> dict:
        """Every rank's `{name: patch}` merged, so all ranks see global metrics.

        The inputs are left unchanged (merging twice would count other ranks twice). Names are agreed
        first: a rank whose shard was empty holds no patch, so it cannot take part in a patch's own
        `sync`; patches missing on some rank are exchanged whole and merged in rank order instead.
        """
        names = sorted(patches)
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, names)
        if all(other == names for other in gathered):
            return {name: self.sync_patch(patches[name]) for name in names}
        everywhere = set.intersection(*(set(other) for other in gathered))
        merged = {name: self.sync_patch(patches[name]) for name in sorted(everywhere)}
        partial = sorted(set().union(*gathered) - everywhere)
        local = {name: _portable(patches[name]) for name in partial if name in patches}
        parts = [None] * self.world_size
        try:
            dist.all_gather_object(parts, local)
        except (AttributeError, TypeError, RuntimeError) as exc:
            raise DistributedError(
                f"metric patches {partial} exist on some ranks only (a rank had no batch) and must be sent "
                f"whole, which needs picklable metric functions ({type(exc).__name__}: {exc}); define "
                "metrics at the top level of a module (no lambdas or local functions)"
            ) from exc
        for name in partial:
            found = [_to_device(part[name], self.device) for part in parts if name in part]
            total = found[0]
            for patch in found[1:]:
                total.add(patch)
            merged[name] = total
        return {name: merged[name] for name in sorted(merged)}

    # ---- coordination ----
    @contextlib.contextmanager
    def main_process_first(self):
        """Rank 0 runs the block, then a barrier releases the other ranks to run it (e.g. reuse a cache)."""
        if not self.is_main:
            self._barrier()
        try:
            yield
        finally:
            if self.is_main:
                self._barrier()

    def _barrier(self) -> None:
        if self._nccl:
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def publish_places(self, read_place) -> None:
        """Start this rank's heartbeat (`deepepochs.parallel.heartbeat`): `read_place()`, the rank's place in the
        loop, written to the job's store every `HEARTBEAT_S` seconds for its peers to read when a collective
        fails. Only for a group deepepochs created (its store's address is known)."""
        address = self._group.store_address
        if address is not None and self._heartbeat is None:
            self._heartbeat = Heartbeat(*address, self.rank, self._group.places_key, read_place)

    def agree_paths(self, place: dict) -> None:
        """Wait for every rank at this point of the loop (`place`: this rank's, its path's `waiting_at` names the
        point) and compare the paths the ranks took since the last one: `DesyncError` when they parted
        (`deepepochs.parallel.path_agreement`). Only for a group deepepochs created (its store is known)."""
        address = self._group.store_address
        if address is None:
            return
        if self._agreement is None:
            self._agreement = PathAgreement(address, self.rank, self.world_size, f"{self._group.places_key}/paths",
                                            self.timeout_s)
        self._agreement.agree(place, self._stall_error)

    def timed_out(self, exc: BaseException, where: str, place: dict | None = None) -> DistributedError | None:
        """If `exc` is a collective's failure (a timeout, or a peer whose connection ended: gloo and NCCL report
        them as RuntimeErrors), the `DistributedError` to raise instead, else None. With heartbeats it names
        every rank's last place and says who waits for whom (`stall_report`; `place`: this rank's when the
        collective failed); without, this rank, where it waited (`where`) and the timeout."""
        if not isinstance(exc, RuntimeError) or isinstance(exc, DistributedError):
            return None
        text = str(exc)
        lowered = text.lower()
        timed_out = "timed out" in lowered or "timeout" in lowered
        if not timed_out and not any(word in lowered for word in _PEER_GONE):
            return None
        after = f"after {self.timeout_s:g} s (Trainer(dist_timeout=...))" if self.timeout_s else "(its group's timeout)"
        first_line = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
        what = (f"a collective timed out {after} in {where}" if timed_out
                else f"a collective failed in {where}: a peer's connection ended")
        if self._heartbeat is not None and place is not None:
            return self._stall_error(what, place, first_line)
        return DistributedError(
            f"rank {self.rank} of {self.world_size}: {what}: another rank did not reach it (hung, blocked in a"
            f" callback or a DataLoader, far slower, or dead). Torch said: {first_line}")

    def _stall_error(self, what: str, place: dict, said: str) -> DistributedError:
        """The error naming every rank's last place, from the peers' heartbeats and this rank's `place`."""
        beat = self._heartbeat
        records, alive = read_places(*self._group.store_address, self._group.places_key, self.world_size, self.rank)
        last = beat.last or {}
        same = last and all(last.get(key) == place.get(key) for key in ("state", "batch", "update", "stage"))
        now = time.time()
        records[self.rank] = {**place, "time": now, "since": last["since"] if same else now}
        alive[self.rank] = True
        ranks = {rank: rank_entry(records[rank], alive[rank], now) for rank in range(self.world_size)}
        paths = {rank: (records[rank] or {}).get("path") for rank in range(self.world_size)}
        return stall_error(self.rank, self.world_size, what, ranks, said, paths)

    def close(self) -> None:
        """Release the process group: destroyed if deepepochs created it and no other trainer still uses it."""
        if self._closed:
            return
        self._closed = True
        self._group.release()  # stops the heartbeat and drops the reducer first (`_drop_reducer`)

    def _drop_reducer(self) -> None:
        """Free the DDP wrapper's reducer (and the logger that holds it) now, while the process group is
        still registered: the reducer holds the group, and freed later (by a garbage collection after the
        group was destroyed) it would drop the group's last reference with the GIL held, where gloo's
        destructor can wait forever for its worker thread (see `process_group.destroy_group`). The heartbeat
        stops first: nothing of this policy writes to the job's store after its release."""
        beat, self._heartbeat = self._heartbeat, None
        self._agreement = None  # its store connection closes with it
        if beat is not None:
            beat.close()
        model, self.model = self.model, None
        if model is not None:
            for name in ("logger", "reducer"):
                if name in vars(model):
                    setattr(model, name, None)


def broadcast_bytes(tensors: list, device: torch.device) -> None:
    """Rank 0's values of `tensors` written into every rank's, bit for bit and in place, with one broadcast
    whatever their dtypes: their bytes packed into one uint8 tensor on `device` (the collective's)."""
    flat = [tensor.detach().reshape(-1).view(torch.uint8).to(device) for tensor in tensors]
    packed = torch.cat(flat)
    dist.broadcast(packed, src=0)
    start = 0
    with torch.no_grad():
        for tensor, part in zip(tensors, flat):
            # A copy first: a slice's byte offset need not suit a wider dtype's view.
            values = packed[start:start + part.numel()].clone().view(tensor.dtype).reshape(tensor.shape)
            tensor.copy_(values)
            start += part.numel()


def is_dtensor(tensor) -> bool:
    """Whether `tensor` is a DTensor (a shard of a tensor spread over the ranks, as FSDP keeps them)."""
    try:
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 (torch >= 2.4; loaded with FSDP anyway)
    except ImportError:
        return False
    return isinstance(tensor, DTensor)


def _portable(patch):
    """A shallow copy of `patch` with its tensors on the CPU, ready to be pickled to another rank."""
    clone = copy.copy(patch)
    clone.__dict__.update(
        {key: _map_tensors(lambda t: t.detach().cpu(), value) for key, value in vars(patch).items()}
    )
    return clone


def _to_device(patch, device: torch.device):
    """`patch` (received from another rank) with its tensors moved to `device`."""
    moved = {key: _map_tensors(lambda t: t.to(device), value) for key, value in vars(patch).items()}
    patch.__dict__.update(moved)
    return patch
