"""Batch rules: splitting a batch into inputs and labels, device moves, sample counts."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from deepepochs.data.sampling import LoaderOrder
from deepepochs.errors import ConfigError

__all__ = [
    "batch_size_of", "call_model", "check_batch_size", "exact_length", "first_tensor", "input_splitter", "lookahead",
    "prepare_batch", "split_batch", "stateful", "to_device",
]


def split_batch(batch, has_loss_fn: bool, target_key: str | None = None):
    """Split one batch into `(batch_x, batch_y)`.

    - tuple/list with a loss function: the last item is the label (any nesting), the rest the inputs;
      one input is passed as itself, several as a tuple (`model(x1, x2)`).
    - tuple/list without a loss function: every item is an input, `batch_y` is None.
    - dict: every field is a keyword argument of the model, `batch_y` is None; with `target_key`
      (`Trainer(targets='<key>')`) `batch_y` is that field, which, as the label of a tuple batch, is no
      model input when a loss function is given, and stays one without (the model computes its loss).
    - anything else without a loss function: the single input.
    """
    if target_key is not None and isinstance(batch, Mapping):
        if target_key not in batch:
            raise ConfigError(f"targets={target_key!r} names a field of dict batches, but this batch has only"
                              f" {sorted(map(str, batch))}; pass the key that holds the labels")
        inputs = {k: v for k, v in batch.items() if k != target_key} if has_loss_fn else batch
        return inputs, batch[target_key]
    if isinstance(batch, (tuple, list)):
        if has_loss_fn:
            if len(batch) < 2:
                raise ConfigError(
                    f"a tuple/list batch needs at least 2 items (inputs..., label) when a loss function is"
                    f" given (got {len(batch)} item); return (x, y) from the dataset, or pass loss=None"
                    " and let the model return its loss"
                )
            xs = tuple(batch[:-1])
            return (xs[0] if len(xs) == 1 else xs), batch[-1]
        return (batch[0] if len(batch) == 1 else tuple(batch)), None
    if isinstance(batch, Mapping):
        return batch, None
    if has_loss_fn:
        raise ConfigError(
            f"cannot split a batch of type {type(batch).__name__} into inputs and a label: with a loss"
            " function, batches must be tuples/lists whose last item is the label (got a bare"
            f" {type(batch).__name__}); yield (x, y), or pass loss=None so the model computes its loss"
        )
    return batch, None


def call_model(model, batch_x):
    """`model(x)`, `model(*x)` for a tuple of inputs, or `model(**x)` for a dict."""
    if type(batch_x) is torch.Tensor:  # the common case first: isinstance(x, Mapping) is an ABC check
        return model(batch_x)
    if isinstance(batch_x, tuple):
        return model(*batch_x)
    if isinstance(batch_x, Mapping):
        return model(**batch_x)
    return model(batch_x)


def to_device(obj, device: torch.device, non_blocking: bool = False):
    """Move tensors in nested tuples/lists/dicts to `device`; other leaves are returned unchanged.

    `non_blocking` is only safe host->device (the copy is ordered on the stream before any use); callers
    pass True for CUDA targets only.
    """
    if isinstance(obj, torch.Tensor):
        # Comparing devices is ~20x cheaper than a no-op .to() call on the per-batch path.
        return obj if obj.device == device else obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, (list, tuple)):
        moved = [to_device(o, device, non_blocking) for o in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*moved)
        return type(obj)(moved)
    if isinstance(obj, Mapping):
        return type(obj)((k, to_device(v, device, non_blocking)) for k, v in obj.items())
    return obj


def first_tensor(obj, accept=None):
    """The first tensor in nested tuples/lists/dicts (depth first) for which `accept(tensor)` holds."""
    if isinstance(obj, torch.Tensor):
        return obj if accept is None or accept(obj) else None
    if isinstance(obj, Mapping):
        obj = obj.values()
    elif not isinstance(obj, (list, tuple)):
        return None
    for item in obj:
        found = first_tensor(item, accept)
        if found is not None:
            return found
    return None


def _has_batch_dim(tensor: torch.Tensor) -> bool:
    return tensor.dim() > 0


def check_batch_size(batch_size, argname: str = "batch_size"):
    """Validate `batch_size=` of fit/test/EpochTask: None, a positive int or a callable (as in 0.6)."""
    if batch_size is None or callable(batch_size):
        return batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(
            f"{argname} must be None (count samples from the tensors), a positive int (the sample count of"
            f" every batch) or a function (batch_x, batch_y) -> int (got {batch_size!r})"
        )
    return batch_size


def batch_size_of(batch_x, batch_y, batch_size_fn=None) -> int:
    """Samples in a batch: `batch_size_fn` itself when it is an int (every batch weighs that much,
    as 0.6's `batch_size=32`), `batch_size_fn(batch_x, batch_y)` when it is a function, else dim 0 of the
    first tensor found in the label, then in the inputs."""
    if batch_size_fn is not None:
        if type(batch_size_fn) is int:
            return batch_size_fn
        return int(batch_size_fn(batch_x, batch_y))
    t = first_tensor(batch_y, _has_batch_dim)
    if t is None:
        t = first_tensor(batch_x, _has_batch_dim)
    if t is None:
        raise ConfigError(
            "cannot infer the number of samples in a batch (no tensor with a batch dimension); pass"
            " batch_size=callable(batch_x, batch_y) -> int to fit()/test()"
        )
    return t.shape[0]


def exact_length(data) -> int | None:
    """The number of batches `data` yields when its length is known to be exact: a list, a tuple, or a
    DataLoader over a map-style dataset with torch's own sequential, random or distributed sampler
    (deepepochs' `DataOrder` and `LoaderOrder` included); None for anything else (a length may be missing
    or an estimate).

    The training loop then knows a task's last batch by counting, so it never reads a batch ahead: a
    batch is loaded right before it runs, which keeps random draws in loading (augmentation in the main
    process) in the uninterrupted order across a resume, and a stateful loader's position exact."""
    if isinstance(data, (list, tuple)):
        return len(data)
    if (isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset)
            and (isinstance(data.sampler, (SequentialSampler, RandomSampler, DistributedSampler, LoaderOrder))
                 or stateful(data))):
        return len(data)
    return None


def stateful(data) -> bool:
    """Whether `data` is a DataLoader that can save and restore its position (torchdata's
    `StatefulDataLoader`: `state_dict()` / `load_state_dict(state)`)."""
    return (isinstance(data, DataLoader) and callable(getattr(data, "state_dict", None))
            and callable(getattr(data, "load_state_dict", None)))


_END = object()  # `lookahead`'s end-of-data sentinel (None can be an item)


def lookahead(iterable: Iterable, window: int) -> Iterator[tuple[object, bool]]:
    """Yield `(item, is_last)` for data of unknown length, whose last batch the window guards need to know
    before it runs (it closes its window and syncs gradients early): the next item is read ahead.

    Except at a window's end: every `window`-th item closes its window by count anyway, so it is yielded
    with `is_last=False` without reading the next one. At a commit point no batch of the next window has
    been read, so a stateful loader's position and torch's generators (augmentation in the main process)
    are as the window left them, and a refit or a snapshot continues exactly from there."""
    it = iter(iterable)
    item, count = next(it, _END), 0
    while item is not _END:
        count += 1
        if count % window == 0:
            yield item, False
            item = next(it, _END)
        else:
            following = next(it, _END)
            yield item, following is _END
            item = following


def batch_splitter(has_loss_fn: bool, device: torch.device, non_blocking: bool, batch_size_fn=None,
                   target_key: str | None = None, counted_dict=None):
    """`split(batch) -> (batch_x, batch_y, n)`: `prepare_batch` with its arguments bound, for a loop.

    On the CPU an `(x, y)` pair of CPU tensors, the common case, costs a few type and flag checks (no
    device objects made, no further call); anything else goes through `prepare_batch`. `counted_dict`, when
    given, is called as `counted_dict(batch, n)` for a dict batch whose samples were counted (no
    `batch_size_fn`): deepepochs 0.6.18 took its number of keys as its size."""
    if not (has_loss_fn and device.type == "cpu" and batch_size_fn is None):
        return lambda batch: prepare_batch(batch, has_loss_fn, device, non_blocking, batch_size_fn, target_key,
                                           counted_dict)
    tensor = torch.Tensor

    def split(batch):
        if type(batch) in (tuple, list) and len(batch) == 2:
            x, y = batch
            if type(x) is tensor and type(y) is tensor and x.is_cpu and y.is_cpu:
                shape = y.shape  # one read: a label of no dimension (shape ()) is no batch of samples
                if shape:
                    return x, y, shape[0]
        return prepare_batch(batch, True, device, non_blocking, None, target_key, counted_dict)

    return split


def prepare_batch(batch, has_loss_fn: bool, device: torch.device, non_blocking: bool, batch_size_fn=None,
                  target_key: str | None = None, counted_dict=None):
    """`(batch_x, batch_y, n)`: split, moved to `device`, and the sample count.

    The common `(x, y)` pair of tensors takes a short path (one call instead of four per batch).
    """
    if has_loss_fn and type(batch) in (tuple, list) and len(batch) == 2 and batch_size_fn is None:
        x, y = batch
        if type(x) is torch.Tensor and type(y) is torch.Tensor and y.dim() > 0:
            if x.device != device:
                x = x.to(device, non_blocking=non_blocking)
            if y.device != device:
                y = y.to(device, non_blocking=non_blocking)
            return x, y, y.shape[0]
    batch_x, batch_y = split_batch(batch, has_loss_fn, target_key)
    batch_x = to_device(batch_x, device, non_blocking)
    batch_y = to_device(batch_y, device, non_blocking)
    n = batch_size_of(batch_x, batch_y, batch_size_fn)
    if counted_dict is not None and batch_size_fn is None and isinstance(batch, Mapping):
        counted_dict(batch, n)
    return batch_x, batch_y, n


def input_splitter(has_loss_fn: bool, device: torch.device, non_blocking: bool, batch_size_fn=None,
                   target_key: str | None = None):
    """`split(batch) -> (batch_x, batch_y, n)` for prediction: batches split as in training (with a loss
    function the last item of a tuple batch is the label), except that a lone tensor or a one-item
    tuple/list is the model's input, so unlabelled data can be predicted with a trainer that has a loss."""
    def split(batch):
        if has_loss_fn and (isinstance(batch, torch.Tensor) or (type(batch) in (tuple, list) and len(batch) == 1)):
            batch_x = to_device(batch if isinstance(batch, torch.Tensor) else batch[0], device, non_blocking)
            return batch_x, None, batch_size_of(batch_x, None, batch_size_fn)
        return prepare_batch(batch, has_loss_fn, device, non_blocking, batch_size_fn, target_key)

    return split
