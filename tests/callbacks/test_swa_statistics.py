"""SWACallback's BatchNorm pass on data that ends: `bn_data` and `bn_batches` against torch's `AveragedModel` and
`update_bn` in a plain loop, bit for bit; an endless stream or a one-shot iterator without `bn_data` refused
when the fit starts; a SIGTERM during the pass ends in a snapshot whose resume recomputes the statistics of
the uninterrupted run."""

from __future__ import annotations

import itertools
import os
import random
import signal

import numpy as np
import pytest
import torch
from state_compare import states_equal  # tests/, on sys.path under pytest
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel, update_bn
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

from deepepochs import ConfigError, Preempted, SnapshotCallback, SWACallback, Trainer

QUIET = dict(log_batch=False, show_info=False, device="cpu")


class Noisy(nn.Module):
    """Adds NumPy's and Python's random draws in training, so every generator of the run matters."""

    def forward(self, x):
        return x + 1e-3 * float(np.random.rand()) - 1e-3 * random.random() if self.training else x


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.ReLU(), Noisy(), nn.Linear(16, 3))


def dataset(n=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g) * 3 + 1, torch.randint(0, 3, (n,), generator=g))


def shuffled(seed=2, n=48):
    """A finite DataLoader shuffling with its own generator."""
    return DataLoader(dataset(n), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(seed))


def stream():
    """The documented endless stream: batches drawn with replacement from the sampler's own generator."""
    data = dataset()
    sampler = RandomSampler(data, replacement=True, num_samples=10**9, generator=torch.Generator().manual_seed(3))
    return DataLoader(data, batch_size=8, sampler=sampler)


def seed():
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)


def trainer_with(swa, callbacks=(), **kw):
    model = make_model()
    return Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), 0.05, momentum=0.9),
                   callbacks=[*callbacks, swa], **QUIET, **kw)


def plain_loop(train, updates, start_update, bn_batches_of):
    """A plain loop over `train` for `updates` SGD steps, `AveragedModel.update_parameters` after each from the
    `start_update`-th on, then `update_bn` over `bn_batches_of(train)`; returns the average's state."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    averaged = AveragedModel(model)
    seed()
    count = 0
    while count < updates:
        for x, y in train:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            count += 1
            if count >= start_update:
                averaged.update_parameters(model)
            if count == updates:
                break
    update_bn(bn_batches_of(train), averaged)
    return averaged.state_dict()


def avg_state(swa) -> dict:
    return {k: v.clone() for k, v in swa.averaged.state_dict().items()}


# ---- what the pass may read ----
def test_an_endless_stream_without_bn_data_is_refused_when_the_fit_starts():
    """Before: the pass iterated the stream of 10**9 samples and fit() never returned. Now nothing trains."""
    trainer = trainer_with(SWACallback(start_update=5), max_updates=12, epochs=None)
    with pytest.raises(ConfigError, match=r"the train data of task 0 is a stream drawn with replacement"
                                          r" \(RandomSampler\(replacement=True\)\), so the pass would not end; pass"
                                          r" bn_data=.*bn_batches=N.*or bn_update=False"):
        trainer.fit(stream())
    assert trainer.loop.run.updates == 0


def test_a_one_shot_generator_of_batches_without_bn_data_is_refused_when_the_fit_starts():
    """Before: the generator was used up by the epoch and the average's statistics were reset to mean 0, var 1."""
    trainer = trainer_with(SWACallback(start_epoch=1), epochs=1)
    batches = (batch for batch in shuffled())
    with pytest.raises(ConfigError, match=r"the train data of task 0 is a one-shot iterator \(got generator\),"
                                          r" which a resumed run could not read as this one did; pass bn_data="):
        trainer.fit(batches)
    assert trainer.loop.run.updates == 0


@pytest.mark.parametrize("make, message", [
    (lambda: SWACallback(1, bn_batches=0), r"SWACallback bn_batches must be an int >= 1, the most batches"),
    (lambda: SWACallback(1, bn_data=iter([])), r"bn_data must be a re-iterable .* \(got list_iterator: a one-shot"),
    (lambda: SWACallback(1, bn_data=stream()), r"bn_data is a stream drawn with replacement .* pass bn_batches=N"),
    (lambda: SWACallback(1, bn_data=5), r"bn_data must be a re-iterable .* \(got int: not iterable\)"),
])
def test_bad_bn_data_and_bn_batches_are_refused_naming_them(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_an_endless_stream_with_bn_data_ends_and_equals_a_plain_loop():
    """start_update=5 under max_updates=12 over the endless stream; the pass over a finite, shuffling bn_data."""
    swa = SWACallback(start_update=5, bn_data=shuffled(seed=7))
    trainer = trainer_with(swa, max_updates=12, epochs=None)
    seed()
    trainer.fit(stream())
    want = plain_loop(stream(), 12, 5, lambda train: shuffled(seed=7))
    assert states_equal(avg_state(swa), want)
    assert float(swa.averaged.module[1].running_var.mean()) > 2  # statistics of the data, not reset ones


def test_bn_batches_bounds_the_pass_over_the_endless_training_stream():
    """bn_batches=3 over the training stream itself: the pass reads its next 3 batches, as a plain loop's
    update_bn over a new iterator of the stream, cut after 3."""
    swa = SWACallback(start_update=5, bn_batches=3)
    trainer = trainer_with(swa, max_updates=12, epochs=None)
    seed()
    trainer.fit(stream())
    want = plain_loop(stream(), 12, 5, lambda train: itertools.islice(train, 3))
    assert states_equal(avg_state(swa), want)


def test_a_one_shot_generator_with_bn_data_trains_and_the_pass_reads_bn_data():
    """A generator of batches trains its one epoch; the pass reads bn_data, bit for bit as update_bn does."""
    swa = SWACallback(start_update=2, bn_data=shuffled(seed=7), bn_batches=4)
    trainer = trainer_with(swa, epochs=1)
    seed()
    trainer.fit(batch for batch in shuffled())
    want = plain_loop(shuffled(), 6, 2, lambda train: itertools.islice(shuffled(seed=7), 4))
    assert states_equal(avg_state(swa), want)


def test_the_pass_over_the_training_data_leaves_its_generator_as_it_was():
    """The pass over the shuffling training DataLoader draws its order from the loader's own generator and
    puts it back: the loader shuffles next what it would have shuffled without the pass."""
    train = shuffled()
    trainer = trainer_with(SWACallback(start_epoch=1), epochs=2)
    seed()
    trainer.fit(train)
    reference = shuffled()
    for _ in range(3):  # two epochs, and the pass's order is that of the epoch after them
        next_order = [y.tolist() for _, y in reference]
    assert [y.tolist() for _, y in train] == next_order


# ---- a signal during the pass ----
class SignalAt(Dataset):
    """bn_data whose `at`-th sample read (0-based, over the process) sends SIGTERM to this process once."""

    def __init__(self, at):
        self.data, self.at, self.reads = dataset(40, seed=9), at, 0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        if self.reads == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        self.reads += 1
        return self.data[index]


def signalling(at=-1):
    """A DataLoader over `SignalAt(at)` (40 samples, 5 batches), shuffling with its own generator."""
    return DataLoader(SignalAt(at), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(4))


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize("source", ["train", "bn_data"])
def test_a_sigterm_during_the_pass_ends_in_a_snapshot_whose_resume_recomputes_the_statistics(tmp_path, source):
    """SIGTERM in the pass's second batch (over the training data, or over bn_data): fit stops with Preempted,
    the average back as the last epoch left it; a new trainer resuming the run runs the pass again and ends
    with update_bn's statistics of a plain loop. Before: the resumed average kept statistics that were never
    recomputed."""
    at = 3 * 40 + 12 if source == "train" else 12  # three epochs of 40 samples, then the pass's second batch
    kw = {} if source == "train" else {"bn_data": signalling(at)}
    swa = SWACallback(start_epoch=2, **kw)
    trainer = trainer_with(swa, [SnapshotCallback(tmp_path)], epochs=3, running_id="run")
    with pytest.raises(Preempted) as info:
        seed()
        trainer.fit(signalling(at) if source == "train" else signalling())
    assert info.value.path is not None
    saved = torch.load(info.value.path, weights_only=True)["averages"]["swa"]["model"]
    assert states_equal(saved, avg_state(swa))  # the rollback put back what the pass had half done
    again = SWACallback(start_epoch=2, **({} if source == "train" else {"bn_data": signalling()}))
    resumed = trainer_with(again, [SnapshotCallback(tmp_path)], epochs=3, running_id="run", resume=True)
    torch.manual_seed(1234)  # what this process drew before must not matter
    resumed.fit(signalling())
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    averaged = AveragedModel(model)
    train = signalling()
    seed()
    for epoch in range(1, 4):
        for x, y in train:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if epoch >= 2:
            averaged.update_parameters(model)
    update_bn(train if source == "train" else signalling(), averaged)
    assert states_equal(avg_state(again), averaged.state_dict())
    assert not states_equal(saved, averaged.state_dict())
