"""`AnalyzeCallback`: per-layer statistics of outputs or gradients, written once per epoch.

Hooks exist only while a training stage runs: they are registered when it starts and removed when it
ends, and also when the fit ends, is interrupted (`on_rollback`, `on_interrupted`) or the trainer closes,
so a model never keeps a deepepochs hook after a crash. Statistics are accumulated on the device (a sum
and a sum of squares per layer, no host sync per batch) and read once per epoch.
"""

from __future__ import annotations

import math

import torch

from deepepochs.callbacks.base import Callback
from deepepochs.compat import run_tensorboard as _run_tensorboard
from deepepochs.config import check_choice
from deepepochs.data.batch_rules import first_tensor
from deepepochs.errors import ConfigError
from deepepochs.reporting.summary_writer import DEFAULT_LOG_DIR

__all__ = ["AnalyzeCallback", "leaf_modules"]

MODES = ("forward", "backward")
#: At most this many values of a layer's first batch go into its histogram.
HISTOGRAM_VALUES = 65536


def leaf_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """`{name: module}` of the modules without children (a childless model is named 'model')."""
    return {name or "model": m for name, m in model.named_modules() if next(m.children(), None) is None}


class _Stat:
    """Running sum, sum of squares and count of the values of one tensor stream, kept on its device,
    plus the first tensor of the epoch as the histogram's sample."""

    __slots__ = ("total", "squares", "count", "sample")

    def __init__(self):
        self.total = self.squares = self.sample = None
        self.count = 0

    def add(self, t: torch.Tensor) -> None:
        x = t.detach().float()
        total = torch.sum(x, dtype=torch.float64)
        squares = torch.sum(x * x, dtype=torch.float64)
        if self.total is None:
            self.total, self.squares = total, squares
            flat = x.flatten()
            if flat.numel() > HISTOGRAM_VALUES:  # an evenly strided subset keeps histograms cheap
                flat = flat[:: -(-flat.numel() // HISTOGRAM_VALUES)]
            self.sample = flat.clone()  # clone: an in-place op (e.g. ReLU(inplace=True)) may follow
        else:
            self.total += total
            self.squares += squares
        self.count += x.numel()


def _first_float(out):
    """The first floating-point tensor of a module output (e.g. the output of an LSTM's `(out, (h, c))`)."""
    return first_tensor(out, torch.Tensor.is_floating_point)


class AnalyzeCallback(Callback):
    """Record layer outputs (`mode='forward'`) or gradients (`mode='backward'`) during training.

    Per epoch and layer it writes the mean and standard deviation over every training batch of the epoch
    and a histogram of the epoch's first batch (an evenly strided subset of at most 65,536 values), to the
    trainer's shared TensorBoard writer:

    - forward: `output/<layer>/mean`, `output/<layer>/std`, histogram `output/<layer>`.
    - backward: the gradient of each layer's output, `grad/<layer>/...` (the gradient of the loss as it is
      backpropagated: under fp16 scaled by the GradScaler, under accumulation weighted by the micro-batch's
      share of the window), and each of the layer's parameter gradients as the optimizer receives them
      (unscaled and normalised over the window), `param_grad/<layer>.<param>/...`.

    The step is the 1-based epoch. Only the main process records.

    Args:
        mode: 'forward' or 'backward'.
        log_dir: the writer's folder (None: the one the trainer's other logging callbacks use).
        layers: names of the modules to watch (as in `model.named_modules()`); None watches every leaf
            module (those without children).
        histograms: also write the histograms.

    Example:
        >>> trainer = Trainer(model, F.cross_entropy, callbacks=[LogCallback(), AnalyzeCallback('backward')])
    """

    def run_tensorboard(self, interactive: bool | None = None):
        """Start TensorBoard on this callback's log folder, as deepepochs 0.6 did: served in the foreground
        until Ctrl-C from an interactive terminal, else a warning with the command (see
        `deepepochs.compat.run_tensorboard`)."""
        return _run_tensorboard(self.log_dir or DEFAULT_LOG_DIR, interactive)

    def __init__(self, mode: str = "forward", log_dir=None, layers=None, histograms: bool = True):
        check_choice("mode", mode, MODES, "'forward' records layer outputs, 'backward' gradients")
        if layers is not None:
            layers = [layers] if isinstance(layers, str) else list(layers)
            if not layers or not all(isinstance(n, str) for n in layers):
                raise ConfigError(f"layers must be None or a non-empty list of module names (got {layers!r})")
        if not isinstance(histograms, bool):
            raise ConfigError(f"histograms must be True or False (got {histograms!r})")
        self.mode = mode
        self.log_dir = log_dir
        self.layers = layers
        self.histograms = histograms
        self._handles: list = []
        self._stats: dict[str, _Stat] = {}
        self._modules: dict[str, torch.nn.Module] | None = None
        self._gathering = False  # FSDP, backward mode, in a training stage: every rank gathers gradients

    @property
    def hook_count(self) -> int:
        """Hooks currently registered by this callback (0 outside a training stage)."""
        return len(self._handles)

    # ---- hooks ----
    def on_before_fit(self, trainer, epochs):
        """Resolve the watched layers (an unknown name is an error now, not at batch 10,000)."""
        self._modules = self._select(trainer.raw_model)

    def on_before_train_epochs(self, trainer, tasks, epoch_idx):
        """Register the hooks for this training stage."""
        self._remove()
        self._stats = {}
        if self._modules is None:
            self._modules = self._select(trainer.raw_model)
        self._gathering = self.mode == "backward" and trainer.dist.shards_model
        if not trainer.is_main_process:
            return
        for name, module in self._modules.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def on_before_optimize(self, trainer, optimize_index):
        """backward: the parameter gradients the optimizers are about to use. Under FSDP each is a shard:
        every rank joins gathering the whole gradient (a collective), rank 0 records it."""
        if self.mode != "backward" or not (self._handles or self._gathering):
            return
        for name, module in self._modules.items():
            for pname, p in module.named_parameters(recurse=False):
                grad = p.grad
                if grad is None:
                    continue
                if hasattr(grad, "full_tensor"):
                    grad = grad.full_tensor()
                if self._handles:
                    self._stat(f"param_grad/{name}.{pname}").add(grad)

    def on_after_train_epochs(self, trainer, tasks, metrics, epoch_idx):
        """Remove the hooks and write the epoch's statistics."""
        self._remove()
        if trainer.is_main_process and self._stats:
            self._write(trainer, epoch_idx + 1)  # TensorBoard steps are 1-based epoch numbers
        self._stats = {}

    def on_after_fit(self, trainer):
        """No hook outlives a fit."""
        self._remove()

    def on_rollback(self, trainer, exception, state):
        """An exception interrupted the loop: remove the hooks at once."""
        self._remove()
        self._stats = {}

    def on_interrupted(self, trainer, exception):
        """Also here, in case another rollback hook failed before this callback's ran."""
        self._remove()

    def on_close(self, trainer):
        """The trainer closes: remove any hook left."""
        self._remove()

    # ---- internals ----
    def _select(self, model) -> dict[str, torch.nn.Module]:
        if self.layers is None:
            return leaf_modules(model)
        named = dict(model.named_modules())
        missing = [n for n in self.layers if n not in named]
        if missing:
            available = ", ".join(repr(n) for n in named if n) or "(none)"
            raise ConfigError(f"AnalyzeCallback layers {missing!r} are not modules of the model; the model's"
                              f" modules are {available}")
        return {n: named[n] for n in self.layers}

    def _stat(self, tag) -> _Stat:
        stat = self._stats.get(tag)
        if stat is None:
            stat = self._stats[tag] = _Stat()
        return stat

    def _forward_hook(self, name):
        backward = self.mode == "backward"
        tag = f"{'grad' if backward else 'output'}/{name}"

        def hook(module, args, output):
            if torch.jit.is_tracing():  # a graph being traced (LogCallback) is not a training batch
                return
            out = _first_float(output)
            if out is None:
                return
            if not backward:
                self._stat(tag).add(out)
            elif out.requires_grad:
                # A hook on this output tensor (not on the module): it lives and dies with the graph, so
                # nothing stays on the model, and in-place ops after the layer are unaffected.
                out.register_hook(lambda grad: self._stat(tag).add(grad))

        return hook

    def _remove(self):
        self._gathering = False
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def _write(self, trainer, epoch_idx):
        writer = trainer.writer(self.log_dir)
        tags = list(self._stats)
        stats = [self._stats[t] for t in tags]
        # One host transfer for every layer's sums.
        sums = torch.stack([torch.stack([s.total, s.squares]).cpu() for s in stats]).tolist()
        for tag, stat, (total, squares) in zip(tags, stats, sums):
            mean = total / stat.count
            std = math.sqrt(max(squares / stat.count - mean * mean, 0.0))
            writer.add_scalar(f"{tag}/mean", mean, epoch_idx)
            writer.add_scalar(f"{tag}/std", std, epoch_idx)
            if self.histograms:
                sample = stat.sample[torch.isfinite(stat.sample)]
                if sample.numel():
                    writer.add_histogram(tag, sample.cpu(), epoch_idx)
        writer.flush()
