"""`trainer.resume_now()` loads a pending `resume=...` before any fit: the run's committed updates, the model
and the optimizer's state are those of the snapshot at once (a plain loop knows its step right after reading
its checkpoint), and the fit that follows ends exactly as a resume loaded by the fit itself, and as the run
never stopped."""

import torch
from state_compare import states_equal
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, SnapshotCallback, Trainer
from deepepochs.checkpoint import read_checkpoint

EPOCHS = 2


class FailAt(Callback):
    """Raises at the `at`-th training batch (None: never): a job that ends before its snapshot's successor."""

    def __init__(self, at=None):
        self.at, self.seen = at, 0

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self.seen += 1
        if self.seen == self.at:
            raise RuntimeError("the job ended")


def make(folder, fail_at=None, resume=True):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(40, 3, generator=g), torch.randn(40, 1, generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer = Trainer(model, F.mse_loss, opt, epochs=EPOCHS, resume=resume, running_id="run", show_info=False,
                      callbacks=[SnapshotCallback(folder, every_n_updates=3, on_signals=()), FailAt(fail_at)],
                      log_batch=False, device="cpu")
    return trainer, data


def test_resume_now_loads_the_snapshot_before_the_fit_and_the_fit_ends_as_if_never_stopped(tmp_path):
    first, data = make(tmp_path, fail_at=14)  # epoch 2, batch 4: the snapshot of update 12 is the newest
    try:
        first.fit(data)
    except RuntimeError as error:
        assert "the job ended" in str(error)
    first.close()
    newest = max((tmp_path / "run").glob("snapshot-u*.ckpt"))
    saved = read_checkpoint(newest)

    trainer, data = make(tmp_path)
    assert trainer.loop.run.updates == 0  # nothing is read before it is asked for
    assert trainer.resume_now() is trainer
    assert trainer.loop.run.updates == 12
    for name, tensor in trainer.raw_model.state_dict().items():
        assert torch.equal(tensor, saved.model[name]), name
    assert trainer.resume_now().loop.run.updates == 12  # honoured once: a second call changes nothing
    resumed = trainer.fit(data)
    trainer.close()

    fit_loaded, data = make(tmp_path)  # the same resume loaded by the fit itself
    by_fit = fit_loaded.fit(data)
    fit_loaded.close()
    whole, data = make(tmp_path / "never", resume=False)
    uninterrupted = whole.fit(data)
    whole.close()
    assert resumed == by_fit == uninterrupted
    for other in (fit_loaded, whole):
        assert states_equal(trainer.raw_model.state_dict(), other.raw_model.state_dict())
        assert states_equal(trainer.opt[0].opt.state_dict(), other.opt[0].opt.state_dict())


def test_resume_now_without_a_pending_resume_changes_nothing(tmp_path):
    trainer, _ = make(tmp_path, resume=False)
    before = {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}
    assert trainer.resume_now() is trainer and trainer.loop.run.updates == 0
    assert all(torch.equal(v, before[k]) for k, v in trainer.raw_model.state_dict().items())
    trainer.close()
