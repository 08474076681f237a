"""State a step carries across batches (`trainer.carried`) is run state: a truncated-BPTT LSTM keeping its
hidden state there resumes from a SIGTERM snapshot mid-epoch, refits after a fault inside a window and
comes back from the learning-rate finder exactly as the uninterrupted run, the same program written as a
plain PyTorch loop (word_language_model's `repackage_hidden`); kept as a plain attribute instead, the
resumed run differs (the fixture sees carried state)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from deepepochs import Callback, Preempted, SnapshotCallback, TrainerBase

TOKENS, BATCH, BPTT, STEPS = 11, 4, 5, 9  # 9 chunks of 5 steps per epoch over 4 parallel streams
needs_sigterm = pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals")


class Boom(Exception):
    pass


class Chunks(Dataset):
    """word_language_model's `batchify` + `get_batch`: chunk i is (inputs, next tokens), each
    `[BATCH, BPTT]`, read in order (the hidden state runs from one chunk into the next)."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.data = torch.randint(0, TOKENS, (BATCH, STEPS * BPTT + 1), generator=g)

    def __len__(self):
        return STEPS

    def __getitem__(self, i):
        return self.data[:, i * BPTT:(i + 1) * BPTT], self.data[:, i * BPTT + 1:(i + 1) * BPTT + 1]


def loader():
    return DataLoader(Chunks(), batch_size=None)


class LSTMModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(TOKENS, 8)
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(16, TOKENS)

    def init_hidden(self, n):
        return torch.zeros(1, n, 16), torch.zeros(1, n, 16)

    def forward(self, x, hidden):
        y, hidden = self.lstm(self.drop(self.embed(x)), hidden)
        return self.out(self.drop(y)), hidden


def detached(hidden):
    """word_language_model's `repackage_hidden`: the values go on, the graph of earlier chunks does not."""
    return tuple(h.detach() for h in hidden)


class TBPTT(TrainerBase):
    """The LSTM's hidden state carried across the chunks of an epoch in `self.carried`, new each epoch."""

    def train_step(self, batch_x, batch_y, **step_args):
        hidden = self.carried.get("hidden")
        if hidden is None or self.loop.batch_idx == 1:
            hidden = self.raw_model.init_hidden(batch_x.shape[0])
        out, hidden = self.model(batch_x, detached(hidden))
        self.carried["hidden"] = hidden
        self.loss(out.reshape(-1, TOKENS), batch_y.reshape(-1))


class TBPTTAttribute(TBPTT):
    """The same step keeping the hidden state as a plain attribute, outside the run state."""

    def train_step(self, batch_x, batch_y, **step_args):
        hidden = getattr(self, "hidden", None)
        if hidden is None or self.loop.batch_idx == 1:
            hidden = self.raw_model.init_hidden(batch_x.shape[0])
        out, self.hidden = self.model(batch_x, detached(hidden))
        self.loss(out.reshape(-1, TOKENS), batch_y.reshape(-1))


def make(cls=TBPTT, callbacks=(), resume=False, k=1):
    model = LSTMModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    torch.manual_seed(7)
    return cls(model, F.cross_entropy, opt, epochs=2, callbacks=list(callbacks), resume=resume, running_id="run",
               gradient_accumulation_steps=k, log_batch=False, show_info=False, device="cpu")


def outcome(trainer, records):
    return {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}, records


def same(a, b):
    (weights_a, records_a), (weights_b, records_b) = a, b
    return records_a == records_b and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_b)


@pytest.fixture(scope="module", params=[1, 2], ids=["k1", "k2"])
def uninterrupted(request):
    k = request.param
    with make(k=k) as trainer:
        return k, outcome(trainer, trainer.fit(loader()))


def test_the_uninterrupted_run_equals_a_plain_pytorch_tbptt_loop(uninterrupted):
    """Two epochs, the hidden state detached between chunks and new each epoch, with accumulation of k
    chunks per update: the weights equal word_language_model's loop written in plain PyTorch."""
    k, (weights, _) = uninterrupted
    model = LSTMModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    torch.manual_seed(7)
    model.train()
    for _ in range(2):
        hidden = model.init_hidden(BATCH)
        chunks = list(loader())
        for start in range(0, STEPS, k):
            window = chunks[start:start + k]
            for x, y in window:
                out, hidden = model(x, detached(hidden))
                (F.cross_entropy(out.reshape(-1, TOKENS), y.reshape(-1)) / len(window)).backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(weights[name], value) for name, value in model.state_dict().items())


class SendAt(Callback):
    """SIGTERM to this process after training batch `batch` (0-based) of epoch `epoch`."""

    def __init__(self, epoch, batch):
        self.epoch, self.batch = epoch, batch

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if trainer.loop.epoch == self.epoch and batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)


def preempted_then_resumed(tmp_path, cls, k):
    """A run stopped by SIGTERM after chunk 6 of epoch 1 (a snapshot at its last commit point), resumed by
    a new trainer in this process after other random draws."""
    with make(cls, [SnapshotCallback(tmp_path), SendAt(1, 5)], k=k) as first, pytest.raises(Preempted) as stop:
        first.fit(loader())
    assert stop.value.path.is_file()
    with make(cls, [SnapshotCallback(tmp_path)], resume=True, k=k) as resumed:
        torch.manual_seed(1234)
        return outcome(resumed, resumed.fit(loader()))


@needs_sigterm
def test_a_sigterm_snapshot_mid_epoch_resumes_bit_identical_with_the_carried_hidden_state(tmp_path, uninterrupted):
    """The snapshot stores the hidden state the last commit point saw; the resumed run's weights and
    records equal the uninterrupted run's bit for bit."""
    k, expected = uninterrupted
    assert same(preempted_then_resumed(tmp_path, TBPTT, k), expected)


@needs_sigterm
def test_a_hidden_state_kept_as_a_plain_attribute_resumes_differently(tmp_path, uninterrupted):
    """The same program with `self.hidden` instead of `self.carried`: the resumed run starts the epoch's
    rest from a fresh hidden state and ends elsewhere (what the carried state is for)."""
    k, expected = uninterrupted
    assert not same(preempted_then_resumed(tmp_path, TBPTTAttribute, k), expected)


class RaiseAt(Callback):
    """Raises once, after training batch `batch` (0-based) of epoch `epoch`."""

    def __init__(self, epoch, batch):
        self.epoch, self.batch, self.done = epoch, batch, False

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if not self.done and trainer.loop.epoch == self.epoch and batch_idx == self.batch:
            self.done = True
            raise Boom


@pytest.mark.parametrize("batch", [4, 7])
def test_a_refit_after_a_fault_continues_from_the_hidden_state_of_the_last_commit_point(uninterrupted, batch):
    """A fault after chunk 5 or 8 of epoch 2 (with k=2, inside a window): the rollback puts the carried
    hidden state back as the last committed update left it, and the refit ends bit-identical."""
    k, expected = uninterrupted
    with make(callbacks=[RaiseAt(2, batch)], k=k) as trainer:
        with pytest.raises(Boom):
            trainer.fit(loader())
        kept = trainer.loop.run.carried
        assert kept is None  # nothing is kept outside a fit: the rollback wrote it into trainer.carried
        assert same(outcome(trainer, trainer.fit(loader())), expected)


def test_find_lr_gives_the_carried_state_back_as_it_was():
    """A sweep runs the step (which writes `trainer.carried`); afterwards the dict holds what it held."""
    with make() as trainer:
        trainer.carried["hidden"] = before = (torch.ones(1, BATCH, 16), torch.zeros(1, BATCH, 16))
        trainer.carried["queue"] = [1, 2]
        trainer.find_lr(loader(), num_steps=5, plot=False)
        assert trainer.carried.keys() == {"hidden", "queue"} and trainer.carried["queue"] == [1, 2]
        assert all(torch.equal(a, b) for a, b in zip(trainer.carried["hidden"], before))
