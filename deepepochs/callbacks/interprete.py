"""`InterpreteCallback`: keep the k samples a per-sample metric ranks best (or worst).

Selection is exact and deterministic: the kept samples are the first k of the whole stage's samples
stably sorted by the metric (descending for `mode='max'`, ascending for `mode='min'`), so among equal
values the sample seen first wins. A heap of `(value, -insertion index, record)` holds them; the index is
unique, so two records are never compared (tensors have no order).
"""

from __future__ import annotations

import heapq
import warnings
from collections.abc import Callable, Mapping

import torch

from deepepochs.callbacks.base import Callback
from deepepochs.compat import run_tensorboard as _run_tensorboard
from deepepochs.config import check_choice
from deepepochs.errors import ConfigError, DeepEpochsWarning
from deepepochs.fsm.events import Event
from deepepochs.metrics import confusion_matrix
from deepepochs.reporting.summary_writer import DEFAULT_LOG_DIR

__all__ = ["InterpreteCallback"]

STAGES = ("train", "val", "test")
DEFAULT_STAGES = ("val", "test")  # 'train' adds per-batch hooks to training, which then leaves the fused edges
#: The hooks that watch the training stage, idle unless 'train' is among the stages.
TRAIN_HOOKS = frozenset({Event.BEFORE_TRAIN_EPOCHS.value, Event.BEFORE_TRAIN_BATCH.value, Event.TRAIN_METRICS.value,
                         Event.AFTER_TRAIN_EPOCHS.value})


class InterpreteCallback(Callback):
    """Keep the `k` samples with the highest (`mode='max'`) or lowest (`mode='min'`) per-sample metric.

    `metric(model_out, batch_y)` runs in the stage's `on_*_metrics` hook, which the default step and a
    custom step's `self.loss(out, y)` calls fire; a custom step that never calls `self.loss` fires none, so
    nothing is collected there (a warning says so). Samples are collected anew each time a stage runs:
    after `fit` the training and validation samples are those of the last epoch; after `test`, the
    test's. Watching 'train' (as 0.6 allowed) scores training outputs without gradients; it adds per-batch
    hooks to training, so training batches take every edge of the machine instead of the fused ones.
    Under DDP the ranks' selections are merged when the stage ends, so every rank holds the best k
    of the whole dataset; ties go to the sample first in the dataset's order for the evaluation shards
    deepepochs makes (sample i on rank i % world size), otherwise to the lower rank.

    Args:
        metric: `metric(preds, targets) -> Tensor[N]`, one score per sample (e.g.
            `lambda p, y: F.cross_entropy(p, y, reduction='none')`). NaN scores are never kept. None (as
            in deepepochs 0.6) keeps no samples, only the confusion matrices (`confusion=True` implied).
        k: how many samples to keep.
        mode: 'max' keeps the highest scores, 'min' the lowest.
        image_data: also write the kept samples' inputs as images (the first input of a multi-input
            model; of a dict, the first field) with a table of their values and labels, to the trainer's
            shared TensorBoard writer: `interprete/val` at the end of fit, `interprete/test` after test.
            Inputs must be `[C, H, W]` (C = 1, 3 or 4) or `[H, W]`; float images are min-max scaled.
        stages: the stages to watch, from ('train', 'val', 'test'); default ('val', 'test').
        class_num: the class count of the confusion matrices (None: inferred from the data).
        confusion: also count a confusion matrix of each watched stage (`confusion_matrix(stage)`; preds
            and targets as `deepepochs.metrics.confusion_matrix` takes them) and write it to TensorBoard as
            an image `interprete/<stage>/confusion` when the stage's samples are written (drawn with
            `plot_confusion` when matplotlib is installed, else as a heat map without numbers).
        log_dir: the writer's folder (None: the one the trainer's other logging callbacks use).

    Example:
        >>> worst = InterpreteCallback(lambda p, y: F.cross_entropy(p, y, reduction='none'), k=10)
        >>> trainer = Trainer(model, F.cross_entropy, callbacks=[worst])
        >>> trainer.test(test_dl)
        >>> for value, pred, label, x in worst.top_samples():
        ...     print(f"{value:.3f}", pred.argmax().item(), label.item())
    """

    def run_tensorboard(self, interactive: bool | None = None):
        """Start TensorBoard on this callback's log folder, as deepepochs 0.6 did: served in the foreground
        until Ctrl-C from an interactive terminal, else a warning with the command (see
        `deepepochs.compat.run_tensorboard`)."""
        return _run_tensorboard(self.log_dir or DEFAULT_LOG_DIR, interactive)

    def __init__(self, metric: Callable | None = None, k: int = 100, mode: str = "max", stages=DEFAULT_STAGES,
                 class_num: int | None = None, log_dir=None, image_data: bool = False, confusion: bool = False):
        if metric is None:
            confusion = True  # as in 0.6: without a metric only the confusion matrices are kept
        elif not callable(metric):
            raise ConfigError(f"metric must be a callable metric(preds, targets) -> Tensor[N], or None to keep"
                              f" only confusion matrices (got {type(metric).__name__})")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"k must be a positive int (got {k!r})")
        check_choice("mode", mode, ("max", "min"), "'max' keeps the highest scores, 'min' the lowest")
        if not isinstance(image_data, bool):
            raise ConfigError(f"image_data must be True or False (got {image_data!r})")
        if not isinstance(confusion, bool):
            raise ConfigError(f"confusion must be True or False (got {confusion!r})")
        if class_num is not None and (isinstance(class_num, bool) or not isinstance(class_num, int) or class_num < 1):
            raise ConfigError(f"class_num must be None (inferred) or a positive int (got {class_num!r})")
        stages = (stages,) if isinstance(stages, str) else tuple(stages)
        if not stages or any(s not in STAGES for s in stages):
            raise ConfigError(f"stages must be a non-empty selection of {STAGES!r} (got {stages!r})")
        self.metric = metric
        self.k = k
        self.mode = mode
        self.image_data = image_data
        self.stages = stages
        self.log_dir = log_dir
        self.confusion = confusion
        self.class_num = class_num
        self.idle_hooks = frozenset() if "train" in stages else TRAIN_HOOKS
        self._matrices: dict[str, torch.Tensor | None] = dict.fromkeys(STAGES)
        self._sign = 1.0 if mode == "max" else -1.0
        self._heaps: dict[str, list] = {s: [] for s in STAGES}
        self._seen = dict.fromkeys(STAGES, 0)
        self._batches = dict.fromkeys(STAGES, 0)
        self._collected = dict.fromkeys(STAGES, 0)
        self._inputs = None
        self._last: str | None = None

    # ---- results ----
    def top_samples(self, stage: str | None = None) -> list[list]:
        """The kept samples, best first, as `[value, pred, label, input]` records.

        `value` is a float; `pred`, `label` and `input` are per-sample CPU tensors (a tuple of them for
        a multi-input model, a dict for dict inputs or outputs). `stage` is 'val' or 'test'; None means
        the stage that ran last.
        """
        if stage is None:
            stage = self._last
            if stage is None:
                return []
        check_choice("stage", stage, STAGES)
        return [list(entry[2]) for entry in sorted(self._heaps[stage], reverse=True)]

    def top(self, stage: str | None = None) -> list[list]:
        """0.6's name of `top_samples`."""
        return self.top_samples(stage)

    def confusion_matrix(self, stage: str | None = None) -> torch.Tensor | None:
        """The `[C, C]` confusion matrix (rows: true class) of the last run of `stage` (None: the stage
        that ran last), with `confusion=True`; None otherwise or before the stage ran."""
        if stage is None:
            stage = self._last
            if stage is None:
                return None
        check_choice("stage", stage, STAGES)
        return self._matrices[stage]

    # ---- hooks: training (with 'train' among the stages) ----
    def on_before_train_epochs(self, trainer, tasks, epoch_idx):
        """Training starts: forget the previous epoch's samples."""
        self._start("train")

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        """Remember the batch's inputs for the metrics hook."""
        self._before_batch("train", batch_x)

    def on_train_metrics(self, trainer, loss, model_out, batch_y, task):
        """Score the batch's samples (without gradients) and keep those among the best k so far."""
        with torch.no_grad():
            self._collect("train", model_out, batch_y)

    def on_after_train_epochs(self, trainer, tasks, metrics, epoch_idx):
        """The epoch's training is done (under DDP: merge the ranks' selections)."""
        self._end(trainer, "train")

    # ---- hooks: validation ----
    def on_before_val_epochs(self, trainer, tasks, epoch_idx):
        """Validation starts: forget the previous validation's samples."""
        self._start("val")

    def on_before_val_batch(self, trainer, batch_x, batch_y, batch_idx):
        """Remember the batch's inputs for the metrics hook."""
        self._before_batch("val", batch_x)

    def on_val_metrics(self, trainer, loss, model_out, batch_y, task):
        """Score the batch's samples and keep those that rank among the best k so far."""
        self._collect("val", model_out, batch_y)

    def on_after_val_epochs(self, trainer, tasks, metrics, epoch_idx):
        """Validation is done (under DDP: merge the ranks' selections)."""
        self._end(trainer, "val")

    def on_after_fit(self, trainer):
        """Log the last epoch's training and validation samples as images (with `image_data`) and their
        confusion matrices (with `confusion`)."""
        for stage in ("train", "val"):
            self._write(trainer, stage)

    # ---- hooks: test ----
    def on_before_test_epochs(self, trainer, tasks):
        """A test starts: forget the previous test's samples."""
        self._start("test")

    def on_before_test_batch(self, trainer, batch_x, batch_y, batch_idx):
        """Remember the batch's inputs for the metrics hook."""
        self._before_batch("test", batch_x)

    def on_test_metrics(self, trainer, loss, model_out, batch_y, task):
        """Score the batch's samples and keep those that rank among the best k so far."""
        self._collect("test", model_out, batch_y)

    def on_after_test_epochs(self, trainer, tasks, metrics):
        """Log the test's samples as images (with `image_data`); under DDP merge the ranks' first."""
        self._end(trainer, "test")
        self._write(trainer, "test")

    def on_interrupted(self, trainer, exception):
        """Drop the reference to the interrupted batch's inputs."""
        self._inputs = None

    # ---- internals ----
    def _start(self, stage):
        if stage not in self.stages:
            return
        self._heaps[stage] = []
        self._seen[stage] = self._batches[stage] = self._collected[stage] = 0
        self._matrices[stage] = None
        self._last = stage

    def _before_batch(self, stage, batch_x):
        if stage in self.stages:
            self._inputs = batch_x
            self._batches[stage] += 1

    def _end(self, trainer, stage):
        self._inputs = None
        if stage in self.stages and trainer.dist.world_size > 1:
            self._merge_ranks(trainer.dist, stage)
            if self.confusion:
                self._merge_matrices(trainer.dist, stage)
        if stage in self.stages and self._batches[stage] and not self._collected[stage]:
            warnings.warn(
                f"InterpreteCallback saw {self._batches[stage]} {stage} batches but no predictions: a custom"
                f" {stage}_step/evaluate_step does not run the on_{stage}_metrics hook; use the default step"
                " or call the callback's metric yourself", DeepEpochsWarning, stacklevel=3)

    def _merge_ranks(self, dist, stage):
        """Every rank's best k, gathered; the best k of them kept on every rank. A rank's j-th sample
        gets the order index j * world_size + rank: its index in the dataset for deepepochs' evaluation
        shards, so ties resolve as in one process."""
        world = dist.world_size
        merged = [(key, -((-neg) * world + rank), record)
                  for rank, heap in enumerate(dist.all_gather_object(self._heaps[stage]))
                  for key, neg, record in heap]
        best = heapq.nlargest(self.k, merged)
        heapq.heapify(best)
        self._heaps[stage] = best

    def _merge_matrices(self, dist, stage):
        """Every rank's matrix, padded to the largest class count seen on any rank, summed."""
        cm = self._matrices[stage]
        size = dist.all_gather_object(0 if cm is None else cm.shape[0])
        c = max(size)
        if c:
            cm = torch.zeros(c, c, dtype=torch.int64) if cm is None else _pad(cm.cpu(), c)
            self._matrices[stage] = dist.reduce_sum(cm)

    def _count(self, stage, model_out, batch_y):
        batch = confusion_matrix(model_out, batch_y, self.class_num).cpu()
        have = self._matrices[stage]
        if have is None:
            self._matrices[stage] = batch
        else:
            c = max(have.shape[0], batch.shape[0])
            self._matrices[stage] = _pad(have, c) + _pad(batch, c)

    def _collect(self, stage, model_out, batch_y):
        if stage not in self.stages:
            return
        if self.confusion:
            self._count(stage, model_out, batch_y)
        batch_x, self._inputs = self._inputs, None
        if self.metric is None:  # confusion matrices only
            self._collected[stage] += 1
            return
        scores = self.metric(model_out, batch_y)
        if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
            got = (f"shape {tuple(scores.shape)}" if isinstance(scores, torch.Tensor)
                   else type(scores).__name__)
            raise ConfigError(f"InterpreteCallback's metric must return one score per sample, a 1-D tensor"
                              f" of shape [N] (got {got}); e.g. use reduction='none' in a loss function")
        self._collected[stage] += 1
        n = scores.shape[0]
        base = self._seen[stage]
        self._seen[stage] += n
        values = scores.detach()
        if values.dtype != torch.float64:
            values = values.float()
        key = values if self._sign > 0 else -values
        heap = self._heaps[stage]
        keep = ~torch.isnan(key)
        if len(heap) == self.k:  # only strictly better samples can enter: on a tie, the earlier one stays
            keep &= key > heap[0][0]
        idx = keep.nonzero().flatten()  # the one host sync of the batch
        if idx.numel() == 0:
            return
        if idx.numel() > self.k:  # at most k of this batch can be kept: the batch's stable top k
            order = torch.sort(key[idx], descending=True, stable=True).indices[: self.k]
            idx = idx[order].sort().values
        picked = values[idx].double().cpu().tolist()
        preds, labels, inputs = (_per_sample(obj, idx, n) for obj in (model_out, batch_y, batch_x))
        for j, pos in enumerate(idx.tolist()):
            value = picked[j]
            entry = (self._sign * value, -(base + pos), [value, preds[j], labels[j], inputs[j]])
            if len(heap) < self.k:
                heapq.heappush(heap, entry)
            elif entry > heap[0]:
                heapq.heapreplace(heap, entry)

    def _write(self, trainer, stage):
        if stage not in self.stages:
            return
        if self.image_data and self._heaps[stage]:
            self._write_images(trainer, stage)
        if self.confusion and self._matrices[stage] is not None and trainer.is_main_process:
            writer = trainer.writer(self.log_dir)
            tag, step, cm = f"interprete/{stage}/confusion", trainer.loop.completed_epochs, self._matrices[stage]
            try:
                from deepepochs.compat import plot_confusion

                writer.add_figure(tag, plot_confusion(cm, title=f"{stage} confusion matrix"), step)
            except ImportError:  # no matplotlib: the matrix as a heat map image, one pixel block per cell
                writer.add_image(tag, _heat_map(cm), step, dataformats="CHW")
            writer.flush()

    def _write_images(self, trainer, stage):
        if not trainer.is_main_process:
            return
        records = self.top_samples(stage)
        images = [_as_image(_first_input(r[3])) for r in records]
        if any(img is None for img in images):
            warnings.warn("InterpreteCallback(image_data=True) needs image inputs of shape [C, H, W] with"
                          " C in 1, 3, 4, or [H, W]; the kept samples were not written as images",
                          DeepEpochsWarning, stacklevel=2)
            return
        writer = trainer.writer(self.log_dir)
        step = trainer.loop.completed_epochs
        tag = f"interprete/{stage}"
        if len({img.shape for img in images}) == 1:
            writer.add_images(tag, torch.stack(images), step, dataformats="NCHW")
        else:
            for i, img in enumerate(images):
                writer.add_image(f"{tag}/{i}", img, step, dataformats="CHW")
        rows = [f"| {i} | {r[0]:.6g} | {_brief(r[2])} | {_brief(r[1])} |" for i, r in enumerate(records)]
        table = "\n".join([f"{self.mode} {self.k} by metric", "", "| rank | value | label | prediction |",
                           "|---|---|---|---|", *rows])
        writer.add_text(tag, table, step)
        writer.flush()


def _pad(cm: torch.Tensor, c: int) -> torch.Tensor:
    """A confusion matrix grown to `c` classes with zero rows and columns."""
    extra = c - cm.shape[0]
    return torch.nn.functional.pad(cm, (0, extra, 0, extra)) if extra else cm


def _heat_map(cm: torch.Tensor, cell: int = 16) -> torch.Tensor:
    """A `[3, C*cell, C*cell]` image of a confusion matrix: white for 0 up to dark blue for the largest
    count, each cell a `cell` x `cell` block (rows: true class)."""
    share = cm.double() / max(int(cm.max()), 1)
    white, blue = torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.03, 0.19, 0.42])
    image = white[:, None, None] + (blue - white)[:, None, None] * share[None].float()
    return image.repeat_interleave(cell, dim=1).repeat_interleave(cell, dim=2)


def _per_sample(obj, idx: torch.Tensor, n: int) -> list:
    """The samples `idx` of a batch structure `obj` of `n` samples, one CPU object per sample.

    Tensors with `n` rows are gathered and each sample cloned (so a kept sample does not keep its batch's
    storage alive); tuples/lists/dicts keep their structure per sample; a list of `n` plain values (e.g.
    collated strings) gives one value per sample; anything else is shared by all samples.
    """
    m = idx.numel()
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[0] != n:
            return [obj.detach().cpu()] * m
        rows = obj.detach().index_select(0, idx.to(obj.device)).cpu()
        return [rows[j].clone() for j in range(m)]
    if isinstance(obj, Mapping):
        fields = {key: _per_sample(value, idx, n) for key, value in obj.items()}
        return [{key: fields[key][j] for key in fields} for j in range(m)]
    if isinstance(obj, (tuple, list)):
        if len(obj) == n and not any(isinstance(v, (torch.Tensor, Mapping, tuple, list)) for v in obj):
            positions = idx.tolist()
            return [obj[p] for p in positions]
        parts = [_per_sample(v, idx, n) for v in obj]
        return [tuple(part[j] for part in parts) for j in range(m)]
    return [obj] * m


def _first_input(x):
    if isinstance(x, Mapping):
        return next(iter(x.values()), None)
    if isinstance(x, tuple):
        return x[0] if x else None
    return x


def _as_image(x) -> torch.Tensor | None:
    """A `[C, H, W]` float image in [0, 1] (uint8 kept as is), or None if `x` is not an image."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        return None
    if x.dim() == 2:
        x = x.unsqueeze(0)
    if x.shape[0] not in (1, 3, 4):
        return None
    if x.dtype == torch.uint8:
        return x
    x = x.float()
    lo, hi = x.min(), x.max()
    return (x - lo) / (hi - lo) if hi > lo else torch.zeros_like(x)


def _brief(x) -> str:
    if isinstance(x, torch.Tensor):
        if x.numel() == 1:
            return f"{x.item():.6g}"
        if x.dim() == 1 and x.is_floating_point():  # class scores: the predicted class
            return f"argmax {int(x.argmax())}"
        return f"tensor{tuple(x.shape)}"
    text = str(x)
    return text if len(text) <= 40 else text[:37] + "..."
