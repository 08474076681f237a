"""The claims of docs/MIGRATION.md, one test (or more) each: what deepepochs 0.6.18 code does when it runs
on this library, and what each intentional difference looks like. The page's own `python` blocks run in
tests/test_migration_doc.py; the tests here check what the page says about them."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, ConfigError, Trainer

QUIET = dict(log_batch=False, show_info=False, device="cpu")


def data(n=64, batch_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(4, 2)


# ---- callback hooks ----
class KeywordHooks(Callback):
    """0.6.18's style: every hook argument by keyword."""

    def __init__(self):
        self.calls = []

    def on_after_train_batch(self, trainer, **kwargs):
        self.calls.append(("batch", kwargs["batch_idx"], kwargs["metrics"]["loss"].item()))

    def on_after_epoch(self, trainer, **kwargs):
        self.calls.append(("epoch", kwargs["epoch_idx"], kwargs["train_metrics"]["loss"].item(),
                           kwargs["val_metrics"]["loss"].item()))


def test_hooks_taking_their_arguments_by_keyword_get_them_by_keyword():
    """`def on_after_train_batch(self, trainer, **kwargs)` is called with the hook's arguments by name; the
    values equal what a positional hook receives, and the records fit() returns."""
    dl = data()
    hooks = KeywordHooks()
    trainer = Trainer(model(), F.cross_entropy, epochs=2, callbacks=[hooks], **QUIET)
    records = trainer.fit(dl, dl)
    batches = [c for c in hooks.calls if c[0] == "batch"]
    assert [c[1] for c in batches] == list(range(len(dl))) * 2
    epochs = [c for c in hooks.calls if c[0] == "epoch"]
    assert [c[1] for c in epochs] == [0, 1]
    assert [c[2] for c in epochs] == records["train"]["loss"]
    assert [c[3] for c in epochs] == records["val"]["loss"]


def test_a_hook_that_takes_neither_form_is_refused_when_attached():
    """A hook whose parameters fit neither the positional nor the keyword call fails at the Trainer."""

    class Wrong(Callback):
        def on_after_train_batch(self, trainer, metric_values):
            pass

    with pytest.raises(ConfigError, match=r"on_after_train_batch.*by position or by keyword"):
        Trainer(model(), F.cross_entropy, callbacks=[Wrong()], **QUIET)


class KeepsMetrics(Callback):
    def __init__(self):
        self.kept = []

    def on_after_train_epoch(self, trainer, task, metrics):
        self.kept.append(metrics)


def test_metric_values_in_user_hooks_answer_item_and_records_stay_plain_floats(tmp_path):
    """0.6.18's hooks got tensors (`metrics['loss'].item()`); here the values are floats that answer `.item()`.
    The trainer's own records hold plain floats (`torch.load(weights_only=True)` reads them back), and a
    value a hook keeps copies and pickles as a plain float."""
    import copy

    dl = data()
    keeper = KeepsMetrics()
    trainer = Trainer(model(), F.cross_entropy, epochs=1, callbacks=[keeper], **QUIET)
    records = trainer.fit(dl)
    kept = keeper.kept[0]
    assert kept["loss"].item() == records["train"]["loss"][0]
    assert kept["loss"] + 1 == records["train"]["loss"][0] + 1 and f"{kept['loss']:.3f}"
    assert type(records["train"]["loss"][0]) is float and type(trainer.history["train"]["loss"][0]) is float
    torch.save({"records": records, "history": trainer.history}, tmp_path / "records.pt")
    loaded = torch.load(tmp_path / "records.pt", weights_only=True)
    assert loaded["records"] == records
    assert type(pickle.loads(pickle.dumps(kept["loss"]))) is float
    assert type(copy.deepcopy(kept)["loss"]) is float
