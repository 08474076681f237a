"""Any training stream stopped anywhere resumes exactly: a job sent SIGTERM at a random update (a
`SnapshotCallback` stops it at the next commit point) and resumed in a new trainer, after other random
draws and with freshly built data, ends with every model, optimizer and scheduler tensor and every record of
the run never stopped, bit for bit in fp32. Streams: a DataLoader over `RandomSampler(replacement=True,
num_samples=k, generator=g)` (with fork workers too), torchdata's `StatefulDataLoader` over such a sampler
(with fork workers too), and a stateful `IterableDataset` without a length (`state_dict()` /
`load_state_dict()`) in a DataLoader, or in a `StatefulDataLoader` with fork workers. The model has dropout
and BatchNorm; the map-style samples get torch noise as they load (not inside torchdata's workers, which
torchdata seeds afresh at a resume; NumPy draws while loading are not kept per update, so a signal inside an
accumulation window leaves NumPy past the window's draws). The run never stopped is itself checked against a
plain PyTorch loop for the sampler with replacement."""

import multiprocessing
import os
import random
import signal

import pytest
import torch
from state_compare import assert_tensors_equal, run_tensors  # tests/, on sys.path under pytest
from torch import nn
from torch.nn import functional as F
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    TensorDataset,
    get_worker_info,
)

from deepepochs import Callback, Optimizer, Preempted, SnapshotCallback, Trainer
from deepepochs.errors import DeepEpochsWarning

N, BATCH, DRAWS, EPOCHS = 40, 4, 36, 3  # an epoch draws 36 of 40 samples with replacement: 9 batches

pytestmark = [
    pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),  # torchdata 0.11 calls a deprecated function
]
FORK = "fork" in multiprocessing.get_all_start_methods()


class Noisy(Dataset):
    """N fixed samples; with `noise`, torch noise is added to each as it is loaded (augmentation)."""

    def __init__(self, noise=True):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)
        self.noise = noise

    def __len__(self):
        return N

    def __getitem__(self, i):
        noise = 0.1 * torch.randn(6) if self.noise else 0
        return self.x[i] + noise, self.y[i]


class Stream(IterableDataset):
    """An endless stream of samples drawn from its own generator, of which each pass yields `DRAWS` (split
    between DataLoader workers); its state (the generator, the samples of the pass yielded) is what decides
    the rest of it."""

    def __init__(self):
        self.generator = torch.Generator().manual_seed(5)
        self.served = 0

    def __iter__(self):
        info = get_worker_info()
        count = DRAWS if info is None else DRAWS // info.num_workers
        while self.served < count:
            self.served += 1
            x = torch.randn(6, generator=self.generator)
            yield x, int(x[0] > 0) + int(x[1] > 0.5)
        self.served = 0  # the next pass

    def state_dict(self):
        return {"generator": self.generator.get_state(), "served": self.served}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])
        self.served = state["served"]


def _replacement_sampler(seed=3):
    return RandomSampler(range(N), replacement=True, num_samples=DRAWS, generator=torch.Generator().manual_seed(seed))


def _data(kind):
    """The training data of stream `kind`, and a validation DataLoader."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader") if kind.startswith("stateful") else None
    fork = {"num_workers": 2, "multiprocessing_context": "fork"}
    train = {
        "replacement": lambda: DataLoader(Noisy(), batch_size=BATCH, sampler=_replacement_sampler()),
        "replacement-batch-sampler": lambda: DataLoader(Noisy(), batch_sampler=BatchSampler(_replacement_sampler(),
                                                                                            BATCH, False)),
        "replacement-workers": lambda: DataLoader(Noisy(), batch_size=BATCH, sampler=_replacement_sampler(), **fork),
        "stateful-loader": lambda: stateful.StatefulDataLoader(Noisy(), batch_size=BATCH,
                                                               sampler=_replacement_sampler()),
        "stateful-loader-workers": lambda: stateful.StatefulDataLoader(Noisy(noise=False), batch_size=BATCH,
                                                                       sampler=_replacement_sampler(), **fork),
        "stream": lambda: DataLoader(Stream(), batch_size=BATCH),
        "stateful-stream-workers": lambda: stateful.StatefulDataLoader(Stream(), batch_size=BATCH, **fork),
    }[kind]()
    val = Noisy(noise=False)
    return train, DataLoader(TensorDataset(val.x[:16], val.y[:16]), batch_size=8)


def _model():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def _trainer(accumulate, callbacks=(), resume=False):
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 4, 0.9)
    trainer = Trainer(model, F.cross_entropy, Optimizer(opt, sched, sched_on="step"), epochs=EPOCHS,
                      callbacks=list(callbacks), resume=resume, running_id="run", device="cpu",
                      gradient_accumulation_steps=accumulate, log_batch=False, show_info=False)
    return trainer, (model, opt, sched)



class SigtermAt(Callback):
    """Sends this process SIGTERM after its `at`-th training batch of the run (1-based), or with
    `validation=True` during the validation after epoch `at`."""

    def __init__(self, at, validation=False):
        self.at, self.validation, self.seen = at, validation, 0

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self.seen += 1
        if self.seen == self.at and not self.validation:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_after_val_batch(self, trainer, metrics, batch_idx):
        if self.validation and trainer.loop.epoch == self.at and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


KINDS = ["replacement", "replacement-batch-sampler", "replacement-workers", "stateful-loader",
         "stateful-loader-workers", "stream", "stateful-stream-workers"]


# The quick set: each stream once with one batch an update, and the loader streams with windows of 2 too;
# the rest (workers, the batch sampler, the stateful stream's windows of 2) is marked slow.
QUICK = {("replacement", 1), ("replacement", 2), ("stateful-loader", 2), ("stream", 1)}


@pytest.fixture(scope="module", params=[pytest.param((kind, k), marks=() if (kind, k) in QUICK else pytest.mark.slow,
                                                     id=f"{kind}-k{k}") for kind in KINDS for k in (1, 2)])
def uninterrupted(request):
    """The run never stopped, for (stream, gradient accumulation)."""
    kind, accumulate = request.param
    if "workers" in kind and not FORK:
        pytest.skip("needs the fork start method")
    trainer, parts = _trainer(accumulate)
    records = trainer.fit(*_data(kind))
    trainer.close()
    return kind, accumulate, run_tensors(*parts), records


def _stop_and_resume(tmp_path, kind, accumulate, signal_at):
    """Fit until `signal_at` stops the run with `Preempted` and a snapshot, then resume it in a new trainer with
    freshly built data after other random draws: its final tensors and records."""
    trainer, _ = _trainer(accumulate, [SnapshotCallback(tmp_path, every_n_updates=None), signal_at])
    with pytest.raises(Preempted) as info:
        trainer.fit(*_data(kind))
    trainer.close()
    assert info.value.path.is_file()
    trainer, parts = _trainer(accumulate, [SnapshotCallback(tmp_path, every_n_updates=None)], resume=True)
    torch.manual_seed(1234)  # a new process draws other numbers before it builds its data
    train, val = _data(kind)
    if kind.startswith("stateful") and kind.endswith("workers") and not signal_at.validation:
        with pytest.warns(DeepEpochsWarning, match="starts its workers' random generators afresh"):
            records = trainer.fit(train, val)
    else:
        records = trainer.fit(train, val)  # no warning (DeepEpochsWarning is an error in the suite)
    trainer.close()
    return run_tensors(*parts), records


def test_a_sigterm_at_a_random_update_then_a_resume_ends_bit_identical_to_the_run_never_stopped(tmp_path,
                                                                                               uninterrupted):
    """SIGTERM after a random batch inside epoch 2 (not in its first or last window), so that the resumed run
    continues that epoch and trains epoch 3: every tensor and record of the uninterrupted run, and no
    warning but torchdata's about its workers' random generators."""
    kind, accumulate, want, want_records = uninterrupted
    per_epoch = 10 if kind == "stateful-stream-workers" else 9
    at = per_epoch + random.Random(f"{kind}-{accumulate}").randrange(2, per_epoch - 1)
    tensors, records = _stop_and_resume(tmp_path, kind, accumulate, SigtermAt(at))
    assert_tensors_equal(tensors, want)
    assert records == want_records


def test_a_sigterm_during_validation_then_a_resume_from_the_epoch_end_snapshot_is_exact(tmp_path, uninterrupted):
    """SIGTERM during epoch 1's validation: the snapshot is the epoch's end (no position), and what the next
    epochs draw comes from the file alone (the loaders' generators, a stateful dataset's state)."""
    kind, accumulate, want, want_records = uninterrupted
    tensors, records = _stop_and_resume(tmp_path, kind, accumulate, SigtermAt(1, validation=True))
    assert_tensors_equal(tensors, want)
    assert records == want_records


def test_the_run_never_stopped_trains_as_a_plain_loop_over_the_sampler_with_replacement():
    """The reference the resumes are compared with: a plain PyTorch loop over the same DataLoader (the
    sampler drawing with replacement from its generator, torch noise while loading), validation after each
    epoch, k=1, fp32: the same weights, optimizer and scheduler state, and validation loss, bit for bit."""
    trainer, parts = _trainer(1)
    records = trainer.fit(*_data("replacement"))
    trainer.close()
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 4, 0.9)
    train, val = _data("replacement")
    losses = []
    for _ in range(EPOCHS):
        model.train()
        for x, y in train:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            total = sum(F.cross_entropy(model(x), y, reduction="sum").item() for x, y in val)
        losses.append(total / 16)
    assert_tensors_equal(run_tensors(*parts), run_tensors(model, opt, sched))
    assert records["val"]["loss"] == pytest.approx(losses, rel=1e-6)


def test_a_sigterm_after_an_epochs_last_batch_read_ahead_resumes_without_a_new_pass(tmp_path):
    """Windows of 2 over the stream of unknown length: its end is read ahead to find epoch 1's last batch
    (the 9th, a window of its own), so the stream's state at that update is already the next pass's; the
    snapshot records that the epoch's stream is over, and the resume trains no extra pass."""
    trainer, parts = _trainer(2)
    want_records = trainer.fit(*_data("stream"))
    trainer.close()
    want = run_tensors(*parts)
    tensors, records = _stop_and_resume(tmp_path, "stream", 2, SigtermAt(9))
    assert_tensors_equal(tensors, want)
    assert records == want_records
