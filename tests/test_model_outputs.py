"""Model outputs shaped by the users' libraries: a mapping output (a dict, a Hugging Face `ModelOutput`)
gives the metrics its 'logits' entry (or its only tensor besides 'loss'); where no rule picks the
predictions, a metric that fails on the output is told how to choose them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from deepepochs import Trainer
from deepepochs.errors import ConfigError
from deepepochs.metrics import accuracy, f1

N, VOCAB, LENGTH, CLASSES, BATCH = 48, 30, 6, 3, 8


def _token_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (N, LENGTH), generator=g)
    return ids, ids[:, 0] % CLASSES


def _dict_batches(ids, labels):
    return [{"input_ids": ids[i:i + BATCH], "attention_mask": torch.ones_like(ids[i:i + BATCH]),
             "labels": labels[i:i + BATCH]} for i in range(0, N, BATCH)]


def _quiet(**kwargs):
    return {"epochs": 1, "device": "cpu", "log_batch": False, "show_info": False, **kwargs}


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=LENGTH, num_labels=CLASSES)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)  # built from its config: nothing downloaded


def test_a_hugging_face_model_gives_the_metrics_its_logits():
    """A tiny BERT built from its config, dict batches, loss=None, targets='labels': accuracy, macro F1
    and a torchmetrics object equal the whole-set values of the trained model's logits, and the loss
    equals the model's own loss."""
    torchmetrics = pytest.importorskip("torchmetrics")
    model = _tiny_bert()
    ids, labels = _token_data()
    batches = _dict_batches(ids, labels)
    stream = torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES, average="micro")
    macro_f1 = lambda preds, targets: f1(preds, targets, average="macro")  # noqa: E731
    with Trainer(model, None, torch.optim.AdamW(model.parameters(), lr=1e-3), targets="labels",
                 metrics=[accuracy, stream, macro_f1], **_quiet()) as trainer:
        trainer.fit(batches)
        scores = trainer.test(batches)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    predicted = out.logits.argmax(1).numpy()
    expected = sklearn_metrics.accuracy_score(labels.numpy(), predicted)
    assert scores["accuracy"] == pytest.approx(expected, abs=1e-6)
    assert scores["MulticlassAccuracy"] == pytest.approx(expected, abs=1e-6)
    assert scores["<lambda>"] == pytest.approx(sklearn_metrics.f1_score(labels.numpy(), predicted, average="macro"),
                                               abs=1e-6)
    assert scores["loss"] == pytest.approx(out.loss.item(), abs=1e-5)


class DictOut(nn.Module):
    """forward(x, labels) -> a plain dict: {'loss', <keys>}, the scores under the first key."""

    def __init__(self, *keys):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, CLASSES)
        self.keys = keys

    def forward(self, x, labels):
        scores = self.lin(x)
        return {"loss": F.cross_entropy(scores, labels), **{key: scores + i for i, key in enumerate(self.keys)}}


def _feature_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 4, generator=g)
    y = x[:, :CLASSES].argmax(1)
    return x, y, [{"x": x[i:i + BATCH], "labels": y[i:i + BATCH]} for i in range(0, N, BATCH)]


@pytest.mark.parametrize("keys", [("logits", "hidden"), ("scores",)], ids=["logits", "only tensor but loss"])
def test_a_dict_output_gives_the_metrics_its_logits_or_its_only_tensor(keys):
    """A plain dict output with loss=None: the metrics (deepepochs' accuracy and a torchmetrics object)
    get 'logits', or the one tensor besides 'loss'; both equal the whole-set computation."""
    torchmetrics = pytest.importorskip("torchmetrics")
    x, y, batches = _feature_data()
    model = DictOut(*keys)
    stream = torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES, average="micro")
    with Trainer(model, None, metrics=[accuracy, stream], targets="labels", **_quiet()) as trainer:
        scores = trainer.test(batches)
    with torch.no_grad():
        expected = (model(x, y)[keys[0]].argmax(1) == y).float().mean().item()
    assert scores["accuracy"] == pytest.approx(expected, abs=1e-6)
    assert scores["MulticlassAccuracy"] == pytest.approx(expected, abs=1e-6)


def test_an_output_no_rule_picks_from_fails_at_the_first_batch_naming_the_fix():
    """Two tensors besides 'loss' and no 'logits': deepepochs' accuracy, a torchmetrics object and a
    function of one's own that expects tensors fail at the first batch with the keys and the lambda fix;
    the fix itself then gives the plain computation."""
    torchmetrics = pytest.importorskip("torchmetrics")
    x, y, batches = _feature_data()
    model = DictOut("start", "end")
    own = lambda preds, targets: (preds.argmax(1) == targets).float().mean()  # noqa: E731
    stream = torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES, average="micro")
    for metric in (accuracy, stream, own):
        with Trainer(model, None, metrics=[metric], targets="labels", **_quiet()) as trainer:
            with pytest.raises(ConfigError, match=r"got the model's whole output as predictions, a dict with keys"
                                                  r" \['loss', 'start', 'end'\].*Trainer\(targets=lambda batch_x,"
                                                  r" out: \(out\['start'\], batch_x\['labels'\]\)\)"):
                trainer.test(batches)
    with Trainer(model, None, metrics=[accuracy], targets=lambda batch_x, out: (out["end"], batch_x["labels"]),
                 **_quiet()) as trainer:
        scores = trainer.test(batches)
    with torch.no_grad():
        assert scores["accuracy"] == pytest.approx((model(x, y)["end"].argmax(1) == y).float().mean().item(),
                                                   abs=1e-6)


def test_a_metric_of_ones_own_may_still_read_an_output_no_rule_picks_from():
    """A metric written for the whole dict keeps working where no rule applies (it does not fail)."""
    x, y, batches = _feature_data()
    model = DictOut("start", "end")
    both = lambda out, targets: ((out["start"] + out["end"]).argmax(1) == targets).float().mean()  # noqa: E731
    with Trainer(model, None, metrics=[both], targets="labels", **_quiet()) as trainer:
        scores = trainer.test(batches)
    with torch.no_grad():
        out = model(x, y)
        assert scores["<lambda>"] == pytest.approx(((out["start"] + out["end"]).argmax(1) == y).float().mean().item(),
                                                   abs=1e-6)
