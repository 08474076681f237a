"""Model outputs: what the metrics get as predictions from a mapping output (a dict, a Hugging Face
`ModelOutput`), and the outputs collected by `Trainer.predict`: per-batch outputs joined along the batch
dimension (nested tuples, lists and dicts kept), and DDP shards put back in dataset order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from deepepochs.errors import ConfigError

__all__ = ["ModelLoss", "concat_batches", "detached", "label_split", "merge_shards", "metric_preds", "unpicked_preds"]


class ModelLoss:
    """`Trainer(model, ModelLoss(1), opt)`: the model computes its own loss from the targets it is given and
    returns it as item `where` of its output, as `(logits, loss)` models do (makemore, minGPT, nanoGPT:
    `ModelLoss(1)`; a key for a mapping output). As with `loss=None`, every item of a batch is a model input:
    an `(x, y)` batch calls `model(x, y)`. The metrics then get no targets from the batch; name them with
    `Trainer(targets=lambda batch_x, out: (out[0], batch_x[1]))`.

    Args:
        where: the index (an int) or key (a str) of the loss in the model's output.
    """

    __slots__ = ("where",)

    def __init__(self, where):
        if isinstance(where, bool) or not isinstance(where, (int, str)):
            raise ConfigError(f"ModelLoss(where) takes the index (an int) or key (a str) of the loss in the model's"
                              f" output, e.g. ModelLoss(1) for a model returning (logits, loss) (got {where!r})")
        self.where = where

    def __repr__(self) -> str:
        return f"ModelLoss({self.where!r})"

    def __call__(self, model_out, batch_y=None):
        """The model's loss, item `where` of `model_out` (the trainer checks that it is a scalar)."""
        try:
            return model_out[self.where]
        except (IndexError, KeyError, TypeError) as e:
            shape = (f"{type(model_out).__name__} of length {len(model_out)}" if isinstance(model_out, (tuple, list))
                     else f"{type(model_out).__name__} with keys {list(model_out)}" if isinstance(model_out, Mapping)
                     else type(model_out).__name__)
            raise ConfigError(f"{self!r} takes the loss from item {self.where!r} of the model's output, but the"
                              f" model returned a {shape} ({type(e).__name__}: {e})") from e


def label_split(loss_fn) -> bool:
    """Whether a batch's last item (or a dict batch's `targets=` field) is the loss's label, apart from the
    model's inputs: with a loss function, not with `loss=None` or `ModelLoss` (every item is an input)."""
    return loss_fn is not None and not isinstance(loss_fn, ModelLoss)


def metric_preds(model_out, targets):
    """The predictions the metrics get from `model_out` when the batches carry their `targets`.

    A tensor (or a tuple, or anything but a mapping) is the predictions as it is. A mapping, such as a
    Hugging Face model's output (`loss`, `logits`, ...), gives its `'logits'` entry; without one, its only
    tensor besides `'loss'`; otherwise no rule applies and the mapping itself is passed on (a metric of the
    user's own may read it; one that fails on it is told how to choose, see `unpicked_preds`). Without
    targets the output is passed on whole: the metrics may read both from it."""
    if targets is None or isinstance(model_out, torch.Tensor) or not isinstance(model_out, Mapping):
        return model_out
    if "logits" in model_out:
        return model_out["logits"]
    tensors = [value for key, value in model_out.items() if key != "loss" and isinstance(value, torch.Tensor)]
    return tensors[0] if len(tensors) == 1 else model_out


def unpicked_preds(preds, who: str, error: Exception) -> ConfigError:
    """The error for metrics that failed on a mapping output no rule of `metric_preds` picked from (`who`:
    "metric 'f1'", or the metrics' names): it names the keys and the fix, `Trainer(targets=lambda ...)`."""
    keys = list(preds)
    key = next((k for k in keys if k != "loss"), "<key>")
    return ConfigError(
        f"{who} got the model's whole output as predictions, a {type(preds).__name__} with keys"
        f" {keys}, and raised {type(error).__name__}: {error}. The metrics get a mapping's 'logits' entry, or"
        " its only tensor besides 'loss'; this output has neither, so say which entry holds the predictions:"
        f" Trainer(targets=lambda batch_x, out: (out[{key!r}], batch_x['labels'])) for dict batches with a"
        " 'labels' field"
    )


def detached(obj, device: torch.device | None):
    """`obj` with every tensor detached and, unless `device` is None, moved to `device` (nested
    tuples/lists/dicts kept; other leaves unchanged)."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach()
        return obj if device is None else obj.to(device)
    if isinstance(obj, (list, tuple)):
        items = [detached(o, device) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, Mapping):
        return type(obj)((k, detached(v, device)) for k, v in obj.items())
    return obj


def _rebuild(like, items):
    if hasattr(like, "_fields"):  # namedtuple
        return type(like)(*items)
    return type(like)(items)


def concat_batches(batches: Sequence):
    """Join per-batch outputs of one structure: tensors with a batch dimension are concatenated along
    dim 0, 0-dim tensors stacked, other leaves kept as a list of per-batch values. None for no batches."""
    if not batches:
        return None
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(batches)) if first.dim() == 0 else torch.cat(list(batches))
    if isinstance(first, (list, tuple)):
        if any(len(b) != len(first) for b in batches):
            raise ConfigError("predict: the model returned sequences of different lengths for different batches"
                              f" ({sorted({len(b) for b in batches})}); return the same structure for every batch")
        return _rebuild(first, [concat_batches([b[i] for b in batches]) for i in range(len(first))])
    if isinstance(first, Mapping):
        keys = list(first)
        if any(list(b) != keys for b in batches):
            raise ConfigError(f"predict: the model returned dicts with different keys for different batches (first"
                              f" {keys}); return the same keys for every batch")
        return type(first)((k, concat_batches([b[k] for b in batches])) for k in keys)
    return list(batches)


def merge_shards(shards: Sequence, world_size: int):
    """Rank-ordered outputs of strided shards (rank r held samples r, r + w, ...) joined in dataset order;
    a rank with no samples contributes None."""
    present = [s for s in shards if s is not None]
    if not present:
        return None
    return _interleave(list(shards), present[0], world_size)


def _interleave(shards, like, world_size):
    if isinstance(like, torch.Tensor):
        if like.dim() == 0:
            raise ConfigError("predict under DDP puts per-sample outputs back in dataset order, but the model"
                              " returned a 0-dim tensor per batch; return tensors with a batch dimension")
        chunks = [s for s in shards if s is not None]
        total = sum(c.shape[0] for c in chunks)
        out = like.new_empty((total, *like.shape[1:]))
        for rank, chunk in enumerate(shards):
            if chunk is not None:
                out[rank::world_size] = chunk  # rank r held dataset indices r, r + w, r + 2w, ...
        return out
    if isinstance(like, (list, tuple)):
        if any(s is not None and len(s) != len(like) for s in shards):
            raise ConfigError("predict under DDP: ranks returned sequences of different lengths; return tensors"
                              " (in tuples or dicts) with a batch dimension")
        return _rebuild(like, [_interleave([None if s is None else s[i] for s in shards], like[i], world_size)
                               for i in range(len(like))])
    if isinstance(like, Mapping):
        return type(like)((k, _interleave([None if s is None else s[k] for s in shards], like[k], world_size))
                          for k in like)
    raise ConfigError(f"predict under DDP puts outputs back in dataset order and needs tensors (in tuples or"
                      f" dicts) from the model (got {type(like).__name__}); return tensors, or predict in one"
                      " process")
