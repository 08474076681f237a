"""torchdata's StatefulDataLoader across epochs: a refit after a fault, and a resume from a mid-epoch or an
epoch-end snapshot in a new trainer (a freshly built loader, other random draws before), end with every
model, optimizer and scheduler tensor of the uninterrupted run, also when the epoch they resume in ends and
the next one begins (torchdata restored mid-epoch leaves its generator elsewhere than the uninterrupted
run's; the library puts it back after making the epoch's iterator). With worker processes and a generator
of the user's own, or augmentation in the main process and neither. torchdata starts its workers' random
generators afresh at a resume, so random draws inside workers cannot continue: a warning says so."""

import shutil
import warnings

import pytest
import torch
from state_compare import assert_tensors_equal, run_tensors  # tests/, on sys.path under pytest
from test_snapshots import FailOnce  # raises once, after a given training batch of a given epoch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from deepepochs import Optimizer, SnapshotCallback, Trainer
from deepepochs.errors import DeepEpochsWarning

stateful = pytest.importorskip("torchdata.stateful_dataloader")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torchdata 0.11 calls a deprecated torch function

N, BATCH, EPOCHS = 40, 4, 3  # 10 batches per epoch, windows of k=2: 5 updates per epoch


class Samples(Dataset):
    """N fixed samples; with `noise`, torch noise is added to each as it is loaded (augmentation)."""

    def __init__(self, noise):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)
        self.noise = noise

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i] + (0.1 * torch.randn(4) if self.noise else 0), self.y[i]


def _loader(kind):
    """A shuffling StatefulDataLoader: with 2 workers and its own generator ('workers'), or augmentation in
    the main process with its own generator ('generator') or torch's global one ('main')."""
    if kind == "workers":
        return stateful.StatefulDataLoader(Samples(noise=False), batch_size=BATCH, shuffle=True, num_workers=2,
                                           generator=torch.Generator().manual_seed(9))
    generator = torch.Generator().manual_seed(9) if kind == "generator" else None
    return stateful.StatefulDataLoader(Samples(noise=True), batch_size=BATCH, shuffle=True, generator=generator)


def _trainer(callbacks=(), resume=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.9)
    trainer = Trainer(model, F.cross_entropy, Optimizer(opt, sched, sched_on="step"), epochs=EPOCHS,
                      callbacks=list(callbacks), resume=resume, running_id="run", gradient_accumulation_steps=2,
                      device="cpu", log_batch=False, show_info=False)
    return trainer, model, opt, sched



@pytest.fixture(scope="module", params=["workers", "generator", "main"])
def uninterrupted(request, tmp_path_factory):
    """The uninterrupted run, writing a snapshot at every update (all kept)."""
    folder = tmp_path_factory.mktemp("snapshots")
    trainer, *parts = _trainer([SnapshotCallback(folder, every_n_updates=1, keep=100)])
    trainer.fit(_loader(request.param))
    trainer.close()
    return request.param, folder / "run", run_tensors(*parts)


@pytest.mark.parametrize("name", ["snapshot-u000000002.ckpt", "snapshot-u000000007.ckpt",
                                  "snapshot-u000000005-epoch1.ckpt"])
def test_a_resume_from_a_snapshot_is_exact_also_in_the_epochs_after_it(tmp_path, uninterrupted, name):
    """Inside epoch 1, inside epoch 2 (each followed by whole epochs) and at epoch 1's end: every tensor of
    the uninterrupted run at the end; no warning, but for a mid-epoch resume with workers the one saying
    that random draws inside them restart."""
    kind, folder, want = uninterrupted
    (tmp_path / "run").mkdir()
    shutil.copy(folder / name, tmp_path / "run")
    trainer, *parts = _trainer([SnapshotCallback(tmp_path, every_n_updates=None)], resume=True)
    torch.manual_seed(1234)  # a new process draws other numbers before it builds its loader
    loader = _loader(kind)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", DeepEpochsWarning)
        trainer.fit(loader)
    trainer.close()
    assert_tensors_equal(run_tensors(*parts), want)
    messages = [str(w.message) for w in seen if issubclass(w.category, DeepEpochsWarning)]
    if kind == "workers" and "epoch1" not in name:
        assert len(messages) == 1 and "starts its workers' random generators afresh" in messages[0]
    else:
        assert messages == []


@pytest.mark.parametrize("at", [(1, 4), (2, 6)])
def test_a_refit_after_a_fault_is_exact_also_in_the_epochs_after_it(uninterrupted, at):
    """A fault inside a window of epoch 1 or 2, then fit again with the same loader."""
    kind, _, want = uninterrupted
    trainer, *parts = _trainer([FailOnce(*at)])
    loader = _loader(kind)
    with pytest.raises(RuntimeError, match="injected"):
        trainer.fit(loader)
    torch.rand(5)
    trainer.fit(loader)
    trainer.close()
    assert_tensors_equal(run_tensors(*parts), want)
