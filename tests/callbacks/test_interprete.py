"""InterpreteCallback: the kept samples are checked against sorting the whole dataset's per-sample
metric, computed with plain PyTorch."""

import re

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import ConfigError, InterpreteCallback, Trainer


def per_sample_ce(preds, targets):
    return F.cross_entropy(preds, targets, reduction="none")


def data(n=61, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g)


def trainer_for(model, callbacks, loss=F.cross_entropy, **kw):
    return Trainer(model, loss, epochs=kw.pop("epochs", 1), device="cpu", callbacks=callbacks,
                   log_batch=False, show_info=False, **kw)


def reference(values, k, mode):
    """Indices of the k best values by a stable sort of the whole dataset (ties: earlier sample first)."""
    order = torch.sort(values, descending=(mode == "max"), stable=True).indices
    return order[:k].tolist()


@pytest.mark.parametrize("mode", ["max", "min"])
def test_keeps_exactly_the_k_best_samples_of_the_whole_dataset(mode):
    """Over uneven batches, the records are the k highest (max) or lowest (min) per-sample losses, best first,
    with each sample's own prediction, label and input."""
    torch.manual_seed(0)
    x, y = data()
    model = nn.Linear(6, 3)
    cb = InterpreteCallback(per_sample_ce, k=9, mode=mode)
    with trainer_for(model, [cb]) as trainer:
        trainer.test(DataLoader(TensorDataset(x, y), batch_size=8))
    with torch.no_grad():
        preds = model(x)
    losses = F.cross_entropy(preds, y, reduction="none")
    expected = reference(losses, 9, mode)
    records = cb.top_samples()
    assert len(records) == 9
    for (value, pred, label, inp), i in zip(records, expected):
        assert value == pytest.approx(losses[i].item(), rel=1e-6)
        assert torch.equal(inp, x[i]) and torch.equal(label, y[i])
        assert torch.allclose(pred, preds[i], atol=1e-6)
        assert inp.device.type == "cpu" and pred.device.type == "cpu"
    values = [r[0] for r in records]
    assert values == sorted(values, reverse=(mode == "max"))


@pytest.mark.parametrize("mode", ["max", "min"])
def test_ties_keep_the_earliest_samples_and_never_compare_tensors(mode):
    """A metric with many equal values keeps exactly the samples a stable sort of the dataset puts first."""
    x, y = data(n=50)
    ids = torch.arange(50)
    scores = (torch.arange(50) * 7 % 4).float()  # values 0..3, each repeated ~12 times
    cb = InterpreteCallback(lambda out, target: scores[target], k=15, mode=mode)

    class Echo(nn.Module):
        def forward(self, x, ids):
            return x.sum(1, keepdim=True).expand(-1, 3) * 0 + ids[:, None].float()

    with trainer_for(Echo(), [cb], loss=lambda out, target: out.sum() * 0) as trainer:
        trainer.test(DataLoader(TensorDataset(x, ids, ids), batch_size=7))
    assert scores[reference(scores, 15, mode)[-1]] in scores[reference(scores, 16, mode)[15:]]  # a tie at k
    got = [inp[1].item() for _, _, _, inp in cb.top_samples()]
    assert got == reference(scores, 15, mode)


def test_multi_input_models_record_a_tuple_of_per_sample_inputs():
    """For model(x1, x2) each record's input is the tuple (x1[i], x2[i])."""

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 3), nn.Linear(2, 3)

        def forward(self, x1, x2):
            return self.a(x1) + self.b(x2)

    torch.manual_seed(0)
    x1, y = data(n=40)
    x2 = torch.randn(40, 2)
    model = TwoInputs()
    cb = InterpreteCallback(per_sample_ce, k=5, mode="min")
    with trainer_for(model, [cb]) as trainer:
        trainer.test(DataLoader(TensorDataset(x1, x2, y), batch_size=16))
    with torch.no_grad():
        losses = F.cross_entropy(model(x1, x2), y, reduction="none")
    for (value, _, label, inp), i in zip(cb.top_samples(), reference(losses, 5, "min")):
        assert isinstance(inp, tuple) and len(inp) == 2
        assert torch.equal(inp[0], x1[i]) and torch.equal(inp[1], x2[i]) and torch.equal(label, y[i])
        assert value == pytest.approx(losses[i].item(), rel=1e-6)


def test_dict_batches_record_dict_inputs_and_outputs():
    """A model taking keyword inputs and returning a dict gives per-sample dict inputs and predictions."""

    class OwnLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(6, 3)

        def forward(self, x, y):
            per_sample = F.cross_entropy(self.linear(x), y, reduction="none")
            return {"loss": per_sample.mean(), "per_sample": per_sample}

    torch.manual_seed(0)
    x, y = data(n=30)
    batches = [{"x": x[i:i + 8], "y": y[i:i + 8]} for i in range(0, 30, 8)]
    model = OwnLoss()
    cb = InterpreteCallback(lambda out, _: out["per_sample"], k=4)
    with trainer_for(model, [cb], loss=None) as trainer:
        trainer.test(batches)
    with torch.no_grad():
        losses = model(x, y)["per_sample"]
    for (value, pred, label, inp), i in zip(cb.top_samples(), reference(losses, 4, "max")):
        assert list(inp) == ["x", "y"] and torch.equal(inp["x"], x[i]) and torch.equal(inp["y"], y[i])
        assert pred["per_sample"].item() == pytest.approx(value) and label is None


def test_kept_samples_do_not_hold_their_batch_in_memory():
    """Each kept tensor owns storage of one sample's size, not a view of the whole batch."""
    x, y = data(n=64)
    cb = InterpreteCallback(per_sample_ce, k=3)
    with trainer_for(nn.Linear(6, 3), [cb]) as trainer:
        trainer.test(DataLoader(TensorDataset(x, y), batch_size=32))
    for _, pred, _, inp in cb.top_samples():
        assert inp.untyped_storage().nbytes() == inp.numel() * inp.element_size()
        assert pred.untyped_storage().nbytes() == pred.numel() * pred.element_size()


def test_validation_samples_are_those_of_the_last_validation_and_stages_are_kept_apart():
    """fit keeps the last epoch's validation samples; test keeps its own; top_samples() shows the latest."""
    torch.manual_seed(0)
    x, y = data(n=60)
    model = nn.Linear(6, 3)
    cb = InterpreteCallback(per_sample_ce, k=6)
    val_dl = DataLoader(TensorDataset(x[40:], y[40:]), batch_size=8)
    with trainer_for(model, [cb], epochs=3, opt=torch.optim.SGD(model.parameters(), lr=0.5)) as trainer:
        trainer.fit(DataLoader(TensorDataset(x[:40], y[:40]), batch_size=8), val_dl)
        with torch.no_grad():
            val_losses = F.cross_entropy(model(x[40:]), y[40:], reduction="none")
        assert [r[0] for r in cb.top_samples()] == pytest.approx(
            [val_losses[i].item() for i in reference(val_losses, 6, "max")], rel=1e-6)
        trainer.test(DataLoader(TensorDataset(x[:20], y[:20]), batch_size=8))
    with torch.no_grad():
        test_losses = F.cross_entropy(model(x[:20]), y[:20], reduction="none")
    assert [r[0] for r in cb.top_samples()] == pytest.approx(
        [test_losses[i].item() for i in reference(test_losses, 6, "max")], rel=1e-6)
    assert [r[0] for r in cb.top_samples("val")] == pytest.approx(
        [val_losses[i].item() for i in reference(val_losses, 6, "max")], rel=1e-6)


def test_nan_scores_are_never_kept():
    """Samples whose score is NaN are skipped instead of breaking the ordering."""
    x, y = data(n=20)
    cb = InterpreteCallback(lambda p, t: torch.where(t == 0, torch.nan, t.float()), k=20)
    with trainer_for(nn.Linear(6, 3), [cb]) as trainer:
        trainer.test(DataLoader(TensorDataset(x, y), batch_size=8))
    assert len(cb.top_samples()) == int((y != 0).sum())


def test_image_data_writes_the_kept_images_and_their_values(tmp_path):
    """image_data=True writes the kept samples' images and a table of values to the shared writer's run."""
    torch.manual_seed(0)
    images, labels = torch.randn(24, 1, 5, 5), torch.randint(0, 3, (24,))
    cb = InterpreteCallback(per_sample_ce, k=4, image_data=True, log_dir=tmp_path)
    model = nn.Sequential(nn.Flatten(), nn.Linear(25, 3))
    with trainer_for(model, [cb], running_id="run") as trainer:
        trainer.test(DataLoader(TensorDataset(images, labels), batch_size=8))
    ea = EventAccumulator(str(tmp_path / "run"), size_guidance={"images": 0, "tensors": 0})
    ea.Reload()
    (image,) = ea.Images("interprete/test")
    assert image.encoded_image_string.startswith(b"\x89PNG")
    (table,) = ea.Tensors("interprete/test/text_summary")
    lines = table.tensor_proto.string_val[0].decode().splitlines()
    rows = [line for line in lines if re.match(r"\| \d", line)]
    assert len(rows) == 4


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"metric": 3}, "metric must be a callable"),
    ({"k": 0}, "k must be a positive int"),
    ({"mode": "best"}, "mode must be one of 'max', 'min'"),
    ({"stages": ("predict",)}, "stages must be a non-empty selection"),
    ({"confusion": 1}, "confusion must be True or False"),
])
def test_bad_arguments_are_refused_with_a_clear_message(kwargs, message):
    """InterpreteCallback validates its arguments when it is created."""
    kwargs = {"metric": per_sample_ce, **kwargs}
    with pytest.raises(ConfigError, match=re.escape(message)):
        InterpreteCallback(**kwargs)


def test_a_metric_returning_one_number_per_batch_is_a_clear_error():
    """A reduced metric (shape []) is refused with a message asking for per-sample scores."""
    x, y = data(n=16)
    with trainer_for(nn.Linear(6, 3), [InterpreteCallback(F.cross_entropy)]) as trainer:
        with pytest.raises(ConfigError, match=re.escape("one score per sample, a 1-D tensor of shape [N]")):
            trainer.test(DataLoader(TensorDataset(x, y), batch_size=8))


def test_the_train_stage_keeps_the_last_epochs_k_worst_training_samples():
    """stages=('train',) (as in 0.6): the kept samples are the k highest per-sample training losses of the
    last epoch, computed here with plain PyTorch (lr=0 keeps the weights fixed); without 'train', training
    batches stay on the fused edges."""
    torch.manual_seed(0)
    x, y = data(n=45)
    model = nn.Linear(6, 3)
    cb = InterpreteCallback(per_sample_ce, k=5, stages=("train",))
    with trainer_for(model, [cb], epochs=2, opt=torch.optim.SGD(model.parameters(), lr=0.0)) as trainer:
        trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8))
        edges = {r.trigger for r in trainer.machine.records()}
    with torch.no_grad():
        losses = per_sample_ce(model(x), y)
    kept = cb.top_samples("train")
    assert [r[0] for r in kept] == pytest.approx([losses[i].item() for i in reference(losses, 5, "max")], rel=1e-6)
    assert all(torch.equal(r[3], x[i]) for r, i in zip(kept, reference(losses, 5, "max")))
    assert "window_step" not in edges  # the training hooks keep batches off the fused edges
    plain = InterpreteCallback(per_sample_ce, k=5)
    with trainer_for(nn.Linear(6, 3), [plain], epochs=1) as trainer:
        trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8))
        assert "window_step" in {r.trigger for r in trainer.machine.records()}


def test_confusion_counts_each_stage_like_sklearn_and_writes_it_as_an_image(tmp_path):
    """confusion=True: the validation and test confusion matrices equal scikit-learn's over the whole data,
    and each is written to TensorBoard as an image."""
    from sklearn.metrics import confusion_matrix as sk_confusion

    torch.manual_seed(0)
    x, y = data(n=50)
    model = nn.Linear(6, 3)
    cb = InterpreteCallback(per_sample_ce, k=3, confusion=True, log_dir=tmp_path)
    dl = DataLoader(TensorDataset(x, y), batch_size=8)
    with trainer_for(model, [cb], running_id="run", opt=torch.optim.SGD(model.parameters(), lr=0.0)) as trainer:
        trainer.fit(dl, dl)
        trainer.test(dl)
    with torch.no_grad():
        expected = sk_confusion(y.numpy(), model(x).argmax(1).numpy(), labels=[0, 1, 2])
    assert cb.confusion_matrix("val").tolist() == expected.tolist()
    assert cb.confusion_matrix().tolist() == expected.tolist()  # the test, which ran last
    assert InterpreteCallback(per_sample_ce).confusion_matrix("val") is None
    ea = EventAccumulator(str(tmp_path / "run"), size_guidance={"images": 0})
    ea.Reload()
    assert {"interprete/val/confusion", "interprete/test/confusion"} <= set(ea.Tags()["images"])
    (image,) = ea.Images("interprete/test/confusion")
    assert image.encoded_image_string.startswith(b"\x89PNG")
