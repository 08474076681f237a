"""The FSDP2 strategy: `Trainer(strategy='fsdp')` shards parameters, gradients and optimizer states over the
ranks with `torch.distributed.fsdp.fully_shard`, where DDP keeps a whole replica on each.

`FSDPPolicy` is `DDPPolicy` (process group, data sharding, global sums and metrics, the training-order
seed) with the model-facing methods replaced:

- `shard_model` (at construction): rank 0's parameters and buffers are broadcast, then `fully_shard` is
  applied to the submodules the wrapping policy picks (children before parents) and to the root; the
  user's optimizers are pointed at the sharded parameters (`fully_shard` replaces every parameter by a
  DTensor one), keeping any state they already held.
- `set_grad_sync` is `FSDPModule.set_requires_gradient_sync`, driven by the spec's `sync_gradients` /
  `skip_gradient_sync` actions as DDP's no_sync is: inside an accumulation window the gradients stay
  local and unsharded, and the window's last micro-batch reduce-scatters their sum.
  `drop_unsynced_gradients` (rollback) discards what such micro-batches left inside FSDP, which
  `zero_grad` cannot reach (see `deepepochs.torch_private.fsdp_drop_unsynced_grads`).
- checkpoints are sharded: every rank writes its own shards through Distributed Checkpoint, nothing is
  gathered (`deepepochs.checkpoint.save`, `deepepochs.checkpoint.shard_storage`). `load_model_state_dict` /
  `load_optimizer_state_dict` load this rank's shards as they are (DTensor values: a sharded checkpoint
  read at this world size, or a backup), or a single file's full states: rank 0's are broadcast and each
  rank keeps its shard (`broadcast_from_rank0=True`). Every rank calls them (they are collectives).
- evaluation: every forward all-gathers parameters, so every rank must run as many forwards as the others.
  Evaluation shards stay exactly-once (`EvalShardSampler`: shards differ by at most one sample, so by at
  most one batch), and `pad_eval` makes a rank whose shard ended early run the forward of a
  `PaddingBatch` (a repeat of its last batch, or the dataset's first sample when its shard is empty)
  while the others run their last batches; data without a length is agreed on batch by batch. The
  engine runs a padding batch's forward only: no step, no hooks, no loss, no metrics (so nothing is
  counted twice), no prediction output. A custom evaluation step must therefore call the model once per
  batch (a second call, or a call of another method, would issue all-gathers the padded rank does not).

Collectives FSDP adds to DDPPolicy's (every rank issues them in the same order): the parameter broadcast
before sharding; FSDP's all-gathers in every forward (and backward, with `reshard_after_forward`) and its
reduce-scatters in synchronising backwards; per evaluation task one exchange of the batch counts (per
batch for data without a length); DCP's planning exchanges when a sharded checkpoint is saved or read,
and the broadcasts of a single file's full states when one is loaded.

Why padding forwards, not padded shards: a duplicated sample would have to be masked in every loss and
metric patch (tensor, mean, confusion, user patches); a forward whose result is dropped needs no mask.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import attrs
import torch
from torch import nn

from deepepochs import torch_private
from deepepochs.data import workers
from deepepochs.data.sampling import PaddingBatch, len_or_minus_one
from deepepochs.errors import ConfigError, DistributedError
from deepepochs.parallel.ddp import DDPPolicy, is_dtensor

__all__ = ["FSDP_KEYS", "FSDPConfig", "FSDPPolicy", "check_strategy_kwargs", "shard_targets"]

#: The keys `Trainer(fsdp_kwargs=...)` accepts, with what each takes.
FSDP_KEYS = {
    "wrap": "None (each submodule holding at least min_params parameters), a module class, a tuple or list of"
            " classes, or a callable (module) -> bool",
    "min_params": "a positive int: the default wrapping policy's threshold (default 1_000_000)",
    "reshard_after_forward": "True (default), False or a positive int (fully_shard's argument)",
    "mixed_precision": "None (from Trainer(precision=...)) or a torch.distributed.fsdp.MixedPrecisionPolicy",
}


def _accepted() -> str:
    return "; ".join(f"{key!r}: {what}" for key, what in FSDP_KEYS.items())


def _check_wrap(_instance, _attribute, wrap) -> None:
    if wrap is None or callable(wrap) and not isinstance(wrap, type):
        return
    classes = wrap if isinstance(wrap, tuple) else (wrap,)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise ConfigError(f"fsdp_kwargs['wrap'] must be {FSDP_KEYS['wrap']} (got {wrap!r})")


def _check_min_params(_instance, _attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"fsdp_kwargs['min_params'] must be {FSDP_KEYS['min_params']} (got {value!r})")


def _check_reshard(_instance, _attribute, value) -> None:
    if not (isinstance(value, bool) or isinstance(value, int) and value > 0):
        raise ConfigError(f"fsdp_kwargs['reshard_after_forward'] must be {FSDP_KEYS['reshard_after_forward']}"
                          f" (got {value!r})")


def _check_mixed_precision(_instance, _attribute, value) -> None:
    if value is None:
        return
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: PLC0415 (heavy import, only when given)
    except ImportError:
        raise ConfigError(f"fsdp_kwargs['mixed_precision'] needs FSDP2 (torch >= 2.6; this is torch"
                          f" {torch.__version__})") from None
    if not isinstance(value, MixedPrecisionPolicy):
        raise ConfigError(f"fsdp_kwargs['mixed_precision'] must be {FSDP_KEYS['mixed_precision']} (got"
                          f" {type(value).__name__}); e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16,"
                          " reduce_dtype=torch.float32)")


def _as_wrap(wrap):
    """One class or a list of them as a tuple of classes; anything else as given (checked next)."""
    if isinstance(wrap, list):
        return tuple(wrap)
    return (wrap,) if isinstance(wrap, type) else wrap


@attrs.define(frozen=True)
class FSDPConfig:
    """`Trainer(strategy='fsdp', fsdp_kwargs={...})`, validated.

    Attributes:
        wrap: which submodules get their own `fully_shard` (one all-gather and one reduce-scatter each),
            before the root gets one for what is left: None shards each submodule whose parameters not
            already in a sharded submodule number at least `min_params` (bottom-up); module classes shard
            every submodule of those classes; a callable `(module) -> bool` shards those it accepts.
        min_params: the default policy's threshold.
        reshard_after_forward: free the gathered parameters after forward (True: less memory, a second
            all-gather in backward) or keep them until backward (False); an int reshards to that many
            ranks (see `fully_shard`).
        mixed_precision: a `MixedPrecisionPolicy`, or None: from `Trainer(precision=...)`, bf16/fp16 gather
            parameters in that dtype and reduce gradients in fp32, fp32 changes nothing.
    """

    wrap: object = attrs.field(default=None, converter=_as_wrap, validator=_check_wrap)
    min_params: int = attrs.field(default=1_000_000, validator=_check_min_params)
    reshard_after_forward: bool | int = attrs.field(default=True, validator=_check_reshard)
    mixed_precision: object = attrs.field(default=None, validator=_check_mixed_precision)


def check_strategy_kwargs(strategy: str, ddp_kwargs: dict, fsdp_kwargs) -> FSDPConfig | None:
    """The `FSDPConfig` of `Trainer(strategy='fsdp', fsdp_kwargs=...)` (None for strategy='ddp'), checked in
    any run, one process included, so a typo shows before a job is scaled out. `ddp_kwargs` (already
    checked) is refused with 'fsdp' and `fsdp_kwargs` with 'ddp': each would be silently unused."""
    if strategy != "fsdp":
        if fsdp_kwargs is not None:
            raise ConfigError(f"fsdp_kwargs applies to strategy='fsdp' only (got strategy={strategy!r} and"
                              f" fsdp_kwargs={fsdp_kwargs!r}); pass strategy='fsdp' or leave fsdp_kwargs out")
        return None
    if ddp_kwargs:
        raise ConfigError(f"ddp_kwargs applies to strategy='ddp' only (got strategy='fsdp' and ddp_kwargs="
                          f"{ddp_kwargs!r}); FSDP's options go in fsdp_kwargs: {_accepted()}")
    if fsdp_kwargs is None:
        return FSDPConfig()
    if not isinstance(fsdp_kwargs, Mapping) or not all(isinstance(k, str) for k in fsdp_kwargs):
        raise ConfigError(f"fsdp_kwargs must be None or a dict with the keys {_accepted()} (got {fsdp_kwargs!r})")
    unknown = sorted(set(fsdp_kwargs) - set(FSDP_KEYS))
    if unknown:
        raise ConfigError(f"fsdp_kwargs has unknown keys {unknown}; accepted keys: {_accepted()}")
    return FSDPConfig(**fsdp_kwargs)


def shard_targets(model: nn.Module, config: FSDPConfig) -> list[nn.Module]:
    """The submodules of `model` (never `model` itself) that get their own `fully_shard`, children before
    their parents (the order `fully_shard` must be applied in)."""
    wrap = config.wrap
    if wrap is None:
        return _by_size(model, config.min_params)
    if isinstance(wrap, tuple):
        def wanted(module):
            return isinstance(module, wrap)
    else:
        def wanted(module):
            answer = wrap(module)
            if not isinstance(answer, bool):
                raise ConfigError(f"fsdp_kwargs['wrap'] must return True or False for a module (got {answer!r}"
                                  f" for {type(module).__name__})")
            return answer
    # modules() lists parents before children; reversed, every module comes after its submodules.
    return [m for m in reversed(list(model.modules())) if m is not model and wanted(m)]


def _by_size(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Bottom-up: a submodule is sharded when its parameters not in an already sharded submodule number at
    least `min_params`."""
    chosen, seen = [], set()

    def left_after(module: nn.Module) -> int:
        if id(module) in seen:  # a module used twice is counted (and sharded) once
            return 0
        seen.add(id(module))
        own = sum(p.numel() for p in module.parameters(recurse=False))
        left = own + sum(left_after(child) for child in module.children())
        if module is not model and left >= min_params:
            chosen.append(module)
            return 0
        return left

    left_after(model)
    return chosen


def _mixed_precision(config: FSDPConfig, precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: PLC0415 (heavy import, FSDP runs only)
    if config.mixed_precision is not None:
        return config.mixed_precision
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    # Gradients are reduced (and accumulated across no-sync micro-batches) in fp32, as DDP's are.
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


class FSDPPolicy(DDPPolicy):
    """Several processes, each holding a shard of every parameter, gradient and optimizer state (FSDP2).

    Args:
        device, split_batches, timeout: as for `DDPPolicy`.
        config: the validated `fsdp_kwargs`.
        precision: `Trainer(precision=...)`, which picks the `MixedPrecisionPolicy` unless `config` names one.
    """

    shards_model = True

    def __init__(self, device: torch.device, split_batches: bool = False, timeout: float = 600,
                 config: FSDPConfig | None = None, precision: str = "fp32"):
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401, PLC0415 (present from torch 2.6)
        except ImportError:
            raise ConfigError(f"strategy='fsdp' needs torch.distributed.fsdp.fully_shard (torch >= 2.6; this is"
                              f" torch {torch.__version__}); upgrade torch or use strategy='ddp'") from None
        super().__init__(device, split_batches, timeout)
        self.config = config if config is not None else FSDPConfig()
        self.precision = precision
        self._grad_sync = True
        self._defer_sync = False  # set_grad_sync(False) really defers the reduce-scatter (see shard_model)

    # ---- model ----
    def shard_model(self, model: nn.Module, optimizers) -> None:
        """Make every rank start from rank 0's weights, shard `model` in place and point `optimizers` at its
        sharded parameters (their states, if any, carried over)."""
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 (heavy import, FSDP runs only)
        names = {p: name for name, p in model.named_parameters()}
        for i, opt in enumerate(optimizers):
            strangers = [tuple(p.shape) for g in opt.param_groups for p in g["params"] if p not in names]
            if strangers:
                raise ConfigError(f"with strategy='fsdp' every optimizer parameter must belong to the model, which"
                                  f" is what gets sharded; optimizer {i} also holds tensors of shapes {strangers[:5]}"
                                  "; make them parameters of the model (or a submodule of it)")
        states = [opt.state_dict() if opt.state else None for opt in optimizers]
        self.broadcast_model(model)  # plain tensors still: rank 0's values everywhere
        options = {"reshard_after_forward": self.config.reshard_after_forward,
                   "mp_policy": _mixed_precision(self.config, self.precision)}
        for module in shard_targets(model, self.config):
            fully_shard(module, **options)
        fully_shard(model, **options)
        sharded = dict(model.named_parameters())
        for opt, state in zip(optimizers, states):
            for group in opt.param_groups:
                # in place: an optimizer may hold the list itself (LBFGS keeps param_groups[0]['params'])
                group["params"][:] = [sharded[names[p]] for p in group["params"]]
            opt.state.clear()
            if state is not None:
                self.load_optimizer_state_dict(model, opt, state)
        self.model = model
        self._defer_sync = torch_private.fsdp_unsynced_grads_private(model)

    def wrap_model(self, model: nn.Module, ddp_kwargs: Mapping | None = None) -> nn.Module:
        """The module training steps call: `model` itself (sharded in place by `shard_model`, perhaps compiled
        since); `ddp_kwargs` is never set with this strategy."""
        return model

    def set_grad_sync(self, enabled: bool) -> None:
        """Whether the next backward reduce-scatters gradients (`FSDPModule.set_requires_gradient_sync`).

        Off, backward leaves each micro-batch's gradient unsharded and local, added to the previous ones;
        the next synchronising backward reduce-scatters the sum. Set only on a change: the call
        walks every submodule. Without `_defer_sync` (torch's FSDP internals not as expected, so a
        rollback could not drop unsynced gradients) every backward reduce-scatters: the same result,
        more communication.
        """
        if enabled != self._grad_sync and self._defer_sync:
            self.model.set_requires_gradient_sync(enabled)
            self._grad_sync = enabled

    def drop_unsynced_gradients(self) -> None:
        """Rollback: discard the gradients no-sync micro-batches left inside FSDP (`zero_grad` only clears the
        sharded `.grad`s)."""
        if self.model is not None and self._defer_sync:
            torch_private.fsdp_drop_unsynced_grads(self.model)

    def local_shards(self, tensors: list) -> list:
        """Each tensor's shard on this rank (a DTensor's local tensor), e.g. for a finite check whose flag is
        then agreed over the ranks."""
        return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]

    # ---- loading states (collectives: every rank calls them) ----
    def load_model_state_dict(self, model: nn.Module, state: Mapping) -> None:
        """Load a model state: this rank's shards (DTensor values: a sharded checkpoint's, or a backup), each
        rank its own; or rank 0's full `state` (a single file; the other ranks' `state` is not read),
        broadcast, each rank keeping its shard. Raises like `load_state_dict(strict=True)` on a mismatch."""
        if any(is_dtensor(value) for value in state.values()):
            model.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415 (heavy import)
            StateDictOptions,
            set_model_state_dict,
        )
        # a copy: the loader replaces the values of the dict it gets by this rank's shards
        set_model_state_dict(model, dict(state) if self.is_main else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def load_optimizer_state_dict(self, model: nn.Module, opt: torch.optim.Optimizer, state: Mapping) -> None:
        """Load an optimizer state keyed by parameter index (as `opt.state_dict()`) into the sharded `opt`:
        this rank's shards (DTensor values), or rank 0's full `state` (the other ranks' is not read)."""
        if any(is_dtensor(value) for values in state.get("state", {}).values() for value in values.values()):
            opt.load_state_dict(state)
            return
        by_name, problem = {}, None
        if self.is_main:  # rank 0's state is the one loaded: key it by parameter name, as DCP wants
            names = {p: name for name, p in model.named_parameters()}
            ordered = [names[p] for group in opt.param_groups for p in group["params"]]
            saved = [i for group in state.get("param_groups", ()) for i in group["params"]]
            if len(saved) != len(ordered):
                problem = f"the optimizer state holds {len(saved)} parameters, the optimizer {len(ordered)}"
            else:
                name_of = dict(zip(saved, ordered))
                by_name = {"state": {name_of[i]: value for i, value in state.get("state", {}).items()},
                           "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]}
                                            for group in state["param_groups"]]}
        # every rank learns rank 0's verdict, so all raise or all join the broadcasts below
        sharded, problem = self.broadcast_object((bool(by_name.get("state")), problem) if self.is_main else None)
        if problem is not None:
            raise ValueError(problem)
        if not sharded:  # hyper-parameters only: no tensor to shard
            opt.load_state_dict(self.broadcast_object(dict(state) if self.is_main else None))
            return
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415 (heavy import)
            StateDictOptions,
            set_optimizer_state_dict,
        )
        set_optimizer_state_dict(model, opt, by_name,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    # ---- evaluation ----
    def sync_eval_buffers(self, model: nn.Module) -> None:
        """Nothing: FSDP never syncs buffers (they stay whole and rank-local, no forward broadcasts them), so
        each rank trains and evaluates its own, as a plain FSDP loop does."""

    def pad_eval(self, data):
        """`data`'s batches, then `PaddingBatch`es until every rank has run as many forwards as the rank with
        the most batches (see the module doc). One exchange of the batch counts per task; for data without
        a length on some rank, one small all-reduce per batch instead."""
        gathered = self.all_gather_object((len_or_minus_one(data), _first_sample(data) is not None))
        counts = [count for count, _ in gathered]
        most = max(counts)
        stuck = [rank for rank, (count, can) in enumerate(gathered) if count == 0 < most and not can]
        if stuck:  # decided on every rank: all raise, none waits for a forward that never comes
            raise DistributedError(
                f"rank(s) {stuck}: their evaluation data yields no batch while another rank's yields {most};"
                " under strategy='fsdp' every forward is a collective, so each rank needs a batch to run the"
                " others' forwards with. Give every rank at least one batch, or pass a DataLoader over a"
                " map-style dataset (sharded and padded automatically)")
        if -1 in counts:
            return self._pad_agreed(data)
        return self._pad_counted(data, most)

    def _pad_counted(self, data, most: int):
        last, ran = None, 0
        for batch in itertools.islice(workers.start(data), most):
            last, ran = batch, ran + 1
            yield batch
        for _ in range(most - ran):
            yield PaddingBatch(last if last is not None else self._some_batch(data))

    def _pad_agreed(self, data):
        batches, last, done = workers.start(data), None, False
        while True:
            if not done:
                try:
                    batch = next(batches)
                except StopIteration:
                    done = True
            if self.all_have(done):  # every rank's data has ended
                return
            if done:
                yield PaddingBatch(last if last is not None else self._some_batch(data))
            else:
                last = batch
                yield batch

    def _some_batch(self, data):
        """A batch for a rank whose data yielded none (an empty shard: fewer samples than ranks)."""
        batch = _first_sample(data)
        if batch is None:  # data without a length that ended at once (counted data is checked in pad_eval)
            raise DistributedError(
                f"rank {self.rank}: its evaluation data yielded no batch while another rank's did; under"
                " strategy='fsdp' every forward is a collective, so this rank needs a batch to run the"
                " others' forwards with. Give every rank at least one batch, or pass a DataLoader over a"
                " map-style dataset (sharded and padded automatically)")
        return batch()


def _first_sample(data):
    """For a DataLoader over a non-empty map-style dataset, a function making a batch of its first sample
    (collated as the DataLoader would); else None."""
    dataset, collate = getattr(data, "dataset", None), getattr(data, "collate_fn", None)
    if dataset is None or collate is None or isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    if len_or_minus_one(dataset) < 1:
        return None
    return lambda: collate([dataset[0]])

