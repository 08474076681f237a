"""Models that take their targets and return `(logits, loss)` (makemore, minGPT, nanoGPT), trained with
`Trainer(model, ModelLoss(1), opt)`. References: the plain loop `logits, loss = model(x, y);
loss.backward(); opt.step(); opt.zero_grad()`, and the metric computed over the whole validation data."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from deepepochs import ConfigError, ModelLoss, Trainer

VOCAB, CONTEXT, EPOCHS = 12, 6, 2
QUIET = dict(log_batch=False, show_info=False, device="cpu")


class Bigrams(nn.Module):
    """makemore's convention: `forward(idx, targets=None) -> (logits, loss)`; loss is None without targets."""

    def __init__(self):
        super().__init__()
        self.emb, self.drop, self.head = nn.Embedding(VOCAB, 16), nn.Dropout(0.2), nn.Linear(16, VOCAB)

    def forward(self, idx, targets=None):
        logits = self.head(self.drop(self.emb(idx)))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


class Words(Dataset):
    """Random token sequences; an item draws a token swap from NumPy and `random` when it is loaded."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        seq = self.tokens[i].clone()
        if np.random.rand() < 0.3:
            seq[random.randrange(CONTEXT)] = int(np.random.randint(VOCAB))
        return seq[:-1], seq[1:]


def seed_all():
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


def loaders():
    return (DataLoader(Words(40, 1), batch_size=8, shuffle=True), DataLoader(Words(20, 2), batch_size=8))


def plain_loop():
    seed_all()
    model = Bigrams()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train, val = loaders()
    accuracies = []  # over the whole validation data, per epoch
    for _ in range(EPOCHS):
        model.train()
        for x, y in train:
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        preds, targets = [], []
        with torch.no_grad():
            for x, y in val:
                preds.append(model(x, y)[0])
                targets.append(y)
        accuracies.append(token_accuracy(torch.cat(preds), torch.cat(targets)).item())
    return model, accuracies


def token_accuracy(preds, targets):
    return (preds.argmax(-1) == targets).float().mean()


def test_a_model_returning_logits_and_loss_trains_with_model_loss_bit_identical_to_the_plain_loop():
    """ModelLoss(1): every batch item goes to the model, item 1 of its output is the loss; shuffled batches,
    dropout and NumPy/`random` draws while loading: the weights equal the plain loop's bit for bit, and the
    validation accuracy (targets picked with targets=) equals the one computed over the whole data."""
    seed_all()
    model = Bigrams()
    trainer = Trainer(model, ModelLoss(1), torch.optim.AdamW(model.parameters(), lr=0.01), epochs=EPOCHS,
                      metrics=[token_accuracy], targets=lambda batch_x, out: (out[0], batch_x[1]), **QUIET)
    records = trainer.fit(*loaders())
    trainer.close()
    reference, accuracies = plain_loop()
    for (name, value), want in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value, want), name
    assert records["val"]["token_accuracy"] == pytest.approx(accuracies, abs=1e-6)
    assert len(records["train"]["loss"]) == EPOCHS


def test_a_tuple_output_with_loss_none_names_model_loss():
    """loss=None with a model returning (logits, loss): the error says to pass loss=ModelLoss(1)."""
    seed_all()
    model = Bigrams()
    trainer = Trainer(model, None, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1, **QUIET)
    with pytest.raises(ConfigError, match=r"\(got tuple\); for a model returning its loss in a tuple, such as"
                                          r" \(logits, loss\), pass loss=ModelLoss\(1\)"):
        trainer.fit(loaders()[0])


def test_model_loss_names_what_the_model_returned_when_the_item_is_missing_and_refuses_a_bad_where():
    """ModelLoss(2) on a 2-tuple says what came back; ModelLoss(1.5) is refused naming what it takes."""
    seed_all()
    model = Bigrams()
    trainer = Trainer(model, ModelLoss(2), torch.optim.SGD(model.parameters(), lr=0.1), epochs=1, **QUIET)
    with pytest.raises(ConfigError, match=r"ModelLoss\(2\) takes the loss from item 2 of the model's output, but"
                                          r" the model returned a tuple of length 2"):
        trainer.fit(loaders()[0])
    with pytest.raises(ConfigError, match=r"the index \(an int\) or key \(a str\) of the loss .* \(got 1.5\)"):
        ModelLoss(1.5)
