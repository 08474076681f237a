"""The one module of deepepochs that may touch private torch attributes; everything else uses public API.

Each private attribute below is used only because no public API does the job. Each has a fallback built
from public API, picked by feature detection at import (the `*_PRIVATE` / `*_PUBLIC` flags below); the
fallback may be slower or coarser, but makes the same step/skip decisions and scale updates.

`GradScaler._per_optimizer_states` (the per-optimizer records that `unscale_` fills and `update` consumes)
    Used to read an optimizer's inf/NaN flags after `unscale_`, to drop one optimizer's record without
    touching the scale, and to hand set-aside records back to `update`. Why: the public API exposes the
    flags only through `step`, which steps or skips by itself with one host read per optimizer, and
    through `update`, which consumes every record at once, so a scale update cannot wait until every
    optimizer of a batch has finished (see `deepepochs.training.precision`).
    Fallback: the flags are computed with `torch.isfinite` over the unscaled gradients and kept in a side
    table here; a record is dropped with `update(new_scale=<the current scale>)`, which resets the
    scaler's per-optimizer stages and keeps the scale and growth tracker; the set-aside records become
    one stand-in parameter whose gradient is inf exactly when a record found inf, unscaled and consumed
    by a plain `update()` (so torch's own scale arithmetic still runs). Coarser: a finite gradient that
    overflows only once unscaled (a scale below 1) counts as non-finite, so its update is skipped.

`torch.autocast._enabled` (torch < 2.4 only)
    Whether an autocast context really enables autocast: torch disables it, with only a warning, for a
    dtype the device does not support. torch >= 2.4 answers publicly (`torch.is_autocast_enabled(device)`
    inside the context), which is used wherever it exists; torch 2.3's `is_autocast_enabled()` takes no
    device and answers for CUDA only.
    Fallback: report enabled; `deepepochs.training.precision` also checks for the "not supported" warning that
    torch emits whenever it disables autocast for an unsupported dtype.

`torch._amp_foreach_non_finite_check_and_unscale_` (the fused check inside `GradScaler.unscale_`)
    Used with a scale of 1 to check an fp32/bf16 update's gradients for inf/NaN in one fused pass with
    one flag (nonfinite='raise'/'skip' when the loss itself is finite). Why: the public ways cost an op
    per gradient plus a stack (4-9x the time on a small model, paid on every update).
    Fallback: `torch.isfinite(grad).all()` per gradient, stacked into one flag.

FSDP2's per-parameter records (`FSDPModule._get_fsdp_state()._fsdp_param_groups[*].fsdp_params`, their
`unsharded_accumulated_grad` and `_unsharded_param.grad`)
    Used on rollback, to drop the gradients that micro-batches run with
    `set_requires_gradient_sync(False)` accumulated: FSDP keeps them unsharded in these records until the
    next synchronising backward reduce-scatters them, and `zero_grad` (which clears the sharded `.grad`s)
    does not reach them, so an interrupted window's gradients would leak into the next window. Why: no
    public API drops them (unshard/reshard exposes the unsharded parameters' `.grad` but not the fp32
    accumulator a mixed-precision policy keeps).
    Fallback: `fsdp_unsynced_grads_private` says False, and `FSDPPolicy` then never turns gradient sync
    off: every micro-batch reduce-scatters its gradients into the sharded `.grad`s, which `zero_grad`
    clears. Same results, more communication inside accumulation windows.

`Module._buffers` and `torch._foreach_copy_` (the model's buffers at every commit point)
    Used to check that the buffer tensors kept from the fit's start are still the ones each module holds
    (a module may replace a buffer instead of changing it in place) and to copy them all with one call,
    once per update (`deepepochs.engine.buffers`). Why: the public ways, `getattr` per buffer and one
    `copy_` per buffer, cost several times as much on a small BatchNorm model, paid on every update.
    Fallback: `getattr(module, name)` and a `copy_` per buffer.
`OptimizedModule._orig_mod` (the module `torch.compile(module)` wraps)
    Used to save, load and log a model the user compiled as the module itself: the wrapper's state dict
    prefixes every key with `_orig_mod.`, which the uncompiled module refuses. Why: torch has no public
    way to reach the module a compiled wrapper holds.
    Fallback: `compiled_module` says None and the wrapper is saved as it is (prefixed keys, which
    loading strips).
`torch.utils.data._utils.signal_handling._set_SIGCHLD_handler` (the DataLoader's SIGCHLD handler)
    Used by `SnapshotCallback` while it listens for signals: torch installs, at the first multi-process
    DataLoader iterator, a SIGCHLD handler that raises `RuntimeError` anywhere in the main thread as soon
    as a worker dies (in the middle of writing a snapshot, too). Installed first, through this call, it can
    be wrapped: a worker killed by a signal the callback listens for is part of the preemption, not a data
    error, and other worker deaths still reach torch's handler. Why: no public API installs it or lets a
    caller filter it.
    Fallback: `install_loader_child_handler` does nothing; torch's handler is then installed by the first
    iterator, after (and around) the callback's, and a worker's death raises as before.
`torch.autograd.graph._engine_run_backward` (what `torch.autograd.backward` calls once its checks pass)
    Used by `backward_seeded` to start a training micro-batch's backward from a seed gradient that
    `steps.backward` made to match its loss. Why: the public call re-derives the pair each time (tuple
    handling, `__torch_function__` lookups, a symbolic shape comparison): ~300 Python opcodes per batch,
    more than the rest of the backward call on a small model. The engine itself still rejects a loss that
    does not require grad, with torch's own message.
    Fallback: `torch.autograd.backward(root, seed)`.
`_MultiProcessingDataLoaderIter._shutdown_workers` (a DataLoader iterator's worker shutdown)
    Used when a fit stops on a listed signal with an iterator whose workers the signal killed: it joins
    them and takes their pids out of the table torch's SIGCHLD handler checks, so that the handler, put
    back when the fit ends, does not raise at exit for workers that were part of the preemption; and when
    any stage ends with iterators still running (`data.workers.stage`), while their queues exist. Why:
    torch shuts an iterator down only when it is exhausted or collected, which a stopped fit's traceback
    delays until after the handler is back, and a collected reference cycle may free the queues first.
    Fallback: `shutdown_loader_workers` does nothing (the workers are shut down when the iterator is
    collected).
`DataLoader._iterator` (the iterator a DataLoader with persistent workers keeps and reuses)
    Used by `drop_persistent_workers` when a stage failed: its workers are shut down (as above) and the
    DataLoader forgets the iterator, so that its next `iter()` starts new workers instead of resuming the
    shut-down ones. Why: torch shuts persistent workers down only when the DataLoader is collected or the
    interpreter exits, and offers no call that makes a DataLoader start afresh.
    Fallback: `drop_persistent_workers` does nothing (the workers stay, as after a normal end).
    Also read by `holds_iterator`, so that a refit or a resume that makes such a DataLoader's iterator anew,
    where the uninterrupted run reused its own, draws no base seed (`deepepochs.engine.loader_starts`).
    Fallback: `holds_iterator` says True (the iterator is made as torch makes it).
`_BaseDataLoaderIter._base_seed` (the base seed a DataLoader iterator drew for its workers)
    Used by `base_seed` to keep, for a DataLoader with persistent workers, the seed its first iterator drew:
    a refit or a resume that must make its iterator anew seeds the new workers from it. Why: torch offers
    no public read of it (`get_worker_info().seed` exists only inside a worker).
    Fallback: `base_seed` says 0 (the new workers' seeds are fixed, though not the first iterator's).
"""

from __future__ import annotations

import math
import warnings
import weakref

import torch

__all__ = [
    "autocast_enabled",
    "backward_seeded",
    "base_seed",
    "buffers_unchanged",
    "copy_tensors",
    "compiled_module",
    "drop_persistent_workers",
    "fsdp_drop_unsynced_grads",
    "fsdp_unsynced_grads_private",
    "grads_finite_on_host",
    "grads_nonfinite",
    "holds_iterator",
    "install_loader_child_handler",
    "scaler_forget",
    "shutdown_loader_workers",
    "scaler_forget_all",
    "scaler_records_private",
    "scaler_unscale",
    "scaler_update_with",
    "sums_pay_off",
]

_RUN_BACKWARD = getattr(getattr(torch.autograd, "graph", None), "_engine_run_backward", None)


def backward_seeded(root: torch.Tensor, seed: torch.Tensor) -> None:
    """`torch.autograd.backward(root, seed)` for a plain tensor `root` and a `seed` of its shape and dtype
    (the caller's to ensure): the same engine call, with the same arguments, without the public call's
    Python checks of the pair."""
    if _RUN_BACKWARD is None:
        torch.autograd.backward(root, seed)
    else:
        _RUN_BACKWARD((root,), (seed,), False, False, (), allow_unreachable=True, accumulate_grad=True)


_PLACEHOLDER = "deepepochs"  # first item of the keys under which set-aside records go back to the scaler


def _probe_scaler_records() -> bool:
    """True when `_per_optimizer_states` behaves as the private path expects, tried on a throwaway scaler."""
    try:  # any failure, whatever its type, means the private layout changed: use the public fallback
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
            param = torch.zeros(1)
            param.grad = torch.full((1,), math.inf)
            opt = torch.optim.SGD([param], lr=0.0)
            scaler.scale(torch.ones(()))
            scaler.unscale_(opt)
            record = scaler._per_optimizer_states.pop(id(opt))["found_inf_per_device"]
            if [float(flag) for flag in record.values()] != [1.0]:
                return False
            scaler._per_optimizer_states[(_PLACEHOLDER, 0)]["found_inf_per_device"] = record
            scaler.update()
            return scaler.get_scale() == 2.0 and len(scaler._per_optimizer_states) == 0
    except Exception:
        return False


def _probe_autocast_query() -> bool:
    """True when `torch.is_autocast_enabled` takes a device type (torch >= 2.4)."""
    try:
        return isinstance(torch.is_autocast_enabled("cpu"), bool)
    except TypeError:
        return False


def _probe_autocast_enabled_attribute() -> bool:
    """True when an autocast context stores its effective on/off in `_enabled`."""
    try:
        return getattr(torch.autocast("cpu", dtype=torch.bfloat16), "_enabled", None) is True
    except Exception:  # an autocast that cannot even be built here: the attribute is no use either
        return False


SCALER_RECORDS_PRIVATE: bool | None = None
"""The scaler functions use `GradScaler._per_optimizer_states` (else their public fallback); None until
`scaler_records_private` probes it at the first fp16 use (the probe imports torch's optimizer machinery,
~1 s, which `import deepepochs` should not pay)."""


def scaler_records_private() -> bool:
    """Whether the private scaler path is used (probed once, on first call)."""
    global SCALER_RECORDS_PRIVATE
    if SCALER_RECORDS_PRIVATE is None:
        SCALER_RECORDS_PRIVATE = _probe_scaler_records()
    return SCALER_RECORDS_PRIVATE
AUTOCAST_QUERY_PUBLIC: bool = _probe_autocast_query()
"""`autocast_enabled` asks `torch.is_autocast_enabled(device_type)` (no private attribute needed)."""
AUTOCAST_ENABLED_PRIVATE: bool = _probe_autocast_enabled_attribute()
"""Without the public query, `autocast_enabled` reads `autocast._enabled` (else trusts torch's warning)."""

# Fallback only: scaler -> {id(optimizer): the flags its unscale_ produced}, until dropped or consumed.
_FALLBACK_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fallback_records(scaler) -> dict[int, list[torch.Tensor]]:
    """The fallback's records of `scaler` (created empty on first use)."""
    records = _FALLBACK_RECORDS.get(scaler)
    if records is None:
        records = _FALLBACK_RECORDS[scaler] = {}
    return records


def _found_inf_public(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """One float32 flag per gradient device, nonzero when a gradient of `optimizer` is inf/NaN."""
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                grad = grad.coalesce().values()
            per_device.setdefault(grad.device, []).append(torch.isfinite(grad).all())
    return [(~torch.stack(finite).all()).float() for finite in per_device.values()]


def _reset_stages_public(scaler: torch.amp.GradScaler, device: torch.device) -> None:
    """Reset every optimizer's unscale stage, keeping the scale and growth tracker (no host sync)."""
    # scale(1) is the scale as a tensor (and initialises it on `device`, as the first scaled loss would)
    scaler.update(new_scale=scaler.scale(torch.ones((), device=device)))


def scaler_unscale(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """`scaler.unscale_(optimizer)`, returning the inf/NaN flags it found (one float32 per device, nonzero:
    found). Private: no public API returns the per-optimizer flags without stepping."""
    scaler.unscale_(optimizer)
    if scaler_records_private():
        return list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
    flags = _found_inf_public(optimizer)
    _fallback_records(scaler)[id(optimizer)] = flags
    return flags


def scaler_forget(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                  device: torch.device) -> list[torch.Tensor] | None:
    """Take back `optimizer`'s record (its flags; None if not unscaled since the last scale update) so it
    may be unscaled again, leaving the scale alone. Private: public `update()` would change the scale.

    `device` is where the scaler keeps its scale (the training device); only the fallback needs it.
    """
    if scaler_records_private():
        state = scaler._per_optimizer_states.pop(id(optimizer), None)
        return None if state is None else list(state["found_inf_per_device"].values())
    flags = _fallback_records(scaler).pop(id(optimizer), None)
    if flags is not None:
        _reset_stages_public(scaler, device)  # coarser: every optimizer may now be unscaled again
    return flags


def scaler_forget_all(scaler: torch.amp.GradScaler, device: torch.device) -> None:
    """Drop every optimizer's record (an interrupted update), leaving the scale alone. Private: public
    `update()` would change the scale. `device` as in `scaler_forget`."""
    if scaler_records_private():
        scaler._per_optimizer_states.clear()  # a defaultdict: entries are recreated on demand
        return
    _fallback_records(scaler).clear()
    _reset_stages_public(scaler, device)  # also drops stages left by direct scaler.unscale_ calls


def scaler_update_with(scaler: torch.amp.GradScaler, records: list[list[torch.Tensor]]) -> None:
    """One `scaler.update()` over set-aside `records` (flag lists from `scaler_forget`, at least one flag
    in all) plus the records still held; halves the scale on any inf, else counts towards growth.
    Private: `update()` reads its records only from the per-optimizer states."""
    if scaler_records_private():
        states = scaler._per_optimizer_states
        for n, flags in enumerate(records):  # keys no optimizer id can take
            states[(_PLACEHOLDER, n)]["found_inf_per_device"] = dict(enumerate(flags))
        scaler.update()  # consumes every record and resets the per-optimizer states
        return
    held = _fallback_records(scaler)
    flags = [flag for record in (*records, *held.values()) for flag in record]
    held.clear()  # update() below consumes the held records, as the private path's update() does
    first = flags[0].device
    found = torch.stack([flag.to(first) for flag in flags]).sum()
    # a stand-in parameter whose gradient is inf exactly when some record found inf (no host sync)
    stand_in = torch.zeros((), device=first)
    stand_in.grad = torch.zeros((), device=first).masked_fill_(found > 0, math.inf)
    scaler.unscale_(torch.optim.SGD([stand_in], lr=0.0))
    scaler.update()


def _probe_grads_check() -> bool:
    """True when the fused check flags exactly the inf/NaN gradients and leaves values alone at scale 1."""
    try:  # any failure, whatever its type, means the op changed: use the public fallback
        one = torch.ones(1)
        bad, good, found_bad, found_good = torch.tensor([2.0, math.nan]), torch.ones(2), torch.zeros(1), torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_([bad], found_bad, one)
        torch._amp_foreach_non_finite_check_and_unscale_([good], found_good, one)
        return float(found_bad) == 1.0 and float(found_good) == 0.0 and bad[0].item() == 2.0
    except Exception:
        return False


GRADS_CHECK_PRIVATE: bool | None = None
"""`grads_nonfinite` uses the fused private check (else its public fallback); None until first probed."""


def grads_nonfinite(grads: list[torch.Tensor]) -> torch.Tensor:
    """A float32 flag on the first gradient's device, nonzero when some gradient holds inf or NaN.

    No host sync: the caller reads the flag when and where it reads others. Private: one fused pass over
    every gradient (what `GradScaler.unscale_` runs), here with a scale of 1, which leaves the values as
    they are; sparse gradients and gradients on another device than the first are checked apart."""
    device = grads[0].device
    found = torch.zeros(1, device=device)
    _check_into(grads, found, torch.ones(1, device=device))
    return found


_HOST_FLAGS: list = []  # [found flag, a memoryview of it, scale 1]: what `grads_finite_on_host` reuses

SUM_CHECK_MEAN_NUMEL = 32768
"""`grads_finite_on_host` sums gradients holding at least this many elements on average (`sums_pay_off`);
smaller ones take the fused check, whose one call costs less than a sum per gradient. On the summed path,
a gradient under a quarter of it (`SUM_CHECK_MIN_NUMEL`) still takes the fused check, with the others that
small."""

SUM_CHECK_MIN_NUMEL = SUM_CHECK_MEAN_NUMEL // 4
"""The smallest gradient `grads_finite_on_host` sums (on its summed path); smaller ones, in one fused call,
cost less than an op and a host read each (15.6k instructions per bias of the MLP's)."""


def sums_pay_off(tensors: list[torch.Tensor]) -> bool:
    """Whether gradients shaped like `tensors` (e.g. an optimizer's parameters) are checked faster by their
    sums than by the fused check: decided once, not per update, where counting costs a few µs."""
    return bool(tensors) and sum(t.numel() for t in tensors) >= SUM_CHECK_MEAN_NUMEL * len(tensors)


def grads_finite_on_host(grads: list[torch.Tensor], summed: bool = False) -> bool:
    """`not grads_nonfinite(grads)` for CPU gradients, read at once (no sync on the CPU); it runs on every
    update.

    `summed` (for large gradients, see `sums_pay_off`): each gradient of `SUM_CHECK_MIN_NUMEL` elements or
    more is summed and the sums added on the host; an inf or NaN anywhere makes the total non-finite. The
    fused check also writes every gradient back (times 1), so on large gradients it takes ~1.6x as long as
    the sums' read-only pass; the smaller ones (biases) take the fused check, one call for all of them,
    where a sum each would cost an op and a host read apiece. A non-finite total is confirmed by the exact
    check of every gradient, because finite values can add up past the dtype's range (fp16 already at
    65504). Otherwise the fused check runs directly, into a flag kept between calls (a fresh flag read
    with `.item()` costs ~2x). The flag is zero between calls (set back only after it was found nonzero,
    or the check raised), and is read and written through a memoryview (a NumPy item costs ~2x)."""
    if summed:
        small, total = [], 0.0
        for g in grads:
            if g.numel() < SUM_CHECK_MIN_NUMEL:
                small.append(g)
            else:
                total += g.sum().item()
        if type(total) is float and math.isfinite(total):  # complex gradients: the exact check
            if not small:
                return True
            grads = small
    if not _HOST_FLAGS:
        found = torch.zeros(1)
        _HOST_FLAGS.extend((found, memoryview(found.numpy()), torch.ones(1)))
    found, view, one = _HOST_FLAGS
    try:
        _check_into(grads, found, one)
    except BaseException:
        view[0] = 0.0  # the next check starts from a zero flag
        raise
    if view[0] == 0.0:
        return True
    view[0] = 0.0
    return False


def _check_into(grads: list[torch.Tensor], found: torch.Tensor, one: torch.Tensor) -> None:
    """Make the zeroed flag `found` nonzero when a gradient is inf/NaN; `one`: a 1 on found's device."""
    global GRADS_CHECK_PRIVATE
    if GRADS_CHECK_PRIVATE is None:
        GRADS_CHECK_PRIVATE = _probe_grads_check()
    if GRADS_CHECK_PRIVATE:
        try:  # the common case: dense gradients on one device (any float dtypes), one fused pass
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
            return
        except RuntimeError:  # sparse or complex gradients, or another device: check those apart
            found.zero_()
            dense = [g for g in grads if g.device == found.device and not (g.is_sparse or g.is_complex())]
            if dense:
                torch._amp_foreach_non_finite_check_and_unscale_(dense, found, one)
            grads = [g for g in grads if not any(g is d for d in dense)]
    if grads:
        found += _nonfinite_public(grads, found.device)


def _nonfinite_public(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The public fallback of `grads_nonfinite`: one isfinite per gradient (sparse: its values)."""
    finite = [torch.isfinite(g.coalesce().values() if g.is_sparse else g).all().to(device) for g in grads]
    return (~torch.stack(finite).all()).float()


def autocast_enabled(ctx: torch.autocast, device_type: str) -> bool:
    """Whether autocast context `ctx` for `device_type` really enables autocast (torch turns it off, with
    a warning, for an unsupported dtype). Private only on torch < 2.4: no device-typed public query."""
    if AUTOCAST_QUERY_PUBLIC:
        with ctx:
            return torch.is_autocast_enabled(device_type)
    if AUTOCAST_ENABLED_PRIVATE:
        return bool(ctx._enabled)
    return True  # coarser: the caller's check of torch's "not supported" warning decides


def _fsdp_params(model) -> list:
    """FSDP2's per-parameter records of every `fully_shard`-ed module in `model` (private attributes)."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 (heavy import, FSDP runs only)
    records = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # torch < 2.10: at most one group per module
                groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
            for group in groups:
                records.extend(group.fsdp_params)
    return records


def fsdp_unsynced_grads_private(model) -> bool:
    """Whether `fsdp_drop_unsynced_grads` can reach FSDP2's unsynced gradients in `model` (probed on the
    sharded model itself: each parameter record has the attributes it clears)."""
    try:  # any failure, whatever its type, means the private layout changed: use the public fallback
        records = _fsdp_params(model)
        # `_unsharded_param` appears at the first all-gather; until then there is no gradient to drop
        return bool(records) and all("unsharded_accumulated_grad" in vars(r) for r in records)
    except Exception:
        return False


def fsdp_drop_unsynced_grads(model) -> None:
    """Drop the gradients FSDP2 holds for `model`'s parameters between no-sync backwards (the unsharded
    gradient and the reduce-dtype accumulator of each parameter). Private: no public API reaches them."""
    for record in _fsdp_params(model):
        record.unsharded_accumulated_grad = None
        unsharded = record.__dict__.get("_unsharded_param")
        if unsharded is not None:
            unsharded.grad = None


def _probe_buffer_records() -> bool:
    """True when modules keep their buffers in a `_buffers` dict and `_foreach_copy_` copies in place."""
    try:  # any failure, whatever its type, means the layout changed: use the public fallback
        module = torch.nn.BatchNorm1d(2)
        dst, src = [torch.zeros(2)], [torch.ones(2)]
        torch._foreach_copy_(dst, src)
        return module._buffers.get("running_mean") is module.running_mean and bool((dst[0] == 1).all())
    except Exception:
        return False


BUFFERS_PRIVATE = _probe_buffer_records()
"""`buffers_unchanged` reads `Module._buffers` and `copy_tensors` calls `_foreach_copy_` (else public ways)."""


def buffers_unchanged(owners: list[tuple[torch.nn.Module, str]], tensors: list[torch.Tensor]) -> bool:
    """Whether module `owners[i][0]` still holds `tensors[i]` as its buffer named `owners[i][1]`."""
    if BUFFERS_PRIVATE:
        return all(module._buffers.get(name) is tensor for (module, name), tensor in zip(owners, tensors))
    return all(getattr(module, name, None) is tensor for (module, name), tensor in zip(owners, tensors))


def copy_tensors(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """`dst[i].copy_(src[i])` for every i (tensors that do not require gradients: nothing is recorded)."""
    if BUFFERS_PRIVATE:
        torch._foreach_copy_(dst, src)
    else:
        for to, value in zip(dst, src):
            to.copy_(value)
def compiled_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module that `model` wraps when `model` is `torch.compile(module)`'s wrapper; else None."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def install_loader_child_handler() -> None:
    """Install torch's DataLoader SIGCHLD handler now (main thread, once per process), so that a handler set
    after it can wrap it (see the module doc); a no-op where torch has no such handler."""
    try:
        from torch.utils.data._utils import signal_handling
        install = signal_handling._set_SIGCHLD_handler
    except (ImportError, AttributeError):
        return
    install()


def drop_persistent_workers(loader) -> None:
    """Shut down the persistent workers a DataLoader keeps and make its next `iter()` start new ones (see the
    module doc); anything else is left alone."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is None or not callable(getattr(iterator, "_shutdown_workers", None)):
        return
    shutdown_loader_workers(iterator)
    loader._iterator = None  # noqa: SLF001


def holds_iterator(loader) -> bool:
    """Whether a DataLoader holds the iterator its persistent workers run in (see the module doc); True when
    that cannot be told."""
    return getattr(loader, "_iterator", True) is not None


def base_seed(iterator) -> int:
    """The base seed a DataLoader iterator drew for its workers (see the module doc); 0 when unknown."""
    seed = getattr(iterator, "_base_seed", 0)
    return seed if isinstance(seed, int) else 0


def shutdown_loader_workers(iterator) -> None:
    """Shut down a multi-process DataLoader iterator's workers now (see the module doc); anything else is
    left alone."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
