"""In one process the batches are the user's: by default (data_order='loader') a fit trains on exactly what
the user's DataLoader yields after the same seed, and every random draw (the permutation, the iterators'
base seeds, dropout, augmentation while loading, validation's loader) happens where the plain loop's does.
References: the plain PyTorch loop `for x, y in dl: loss_fn(model(x), y).backward(); opt.step();
opt.zero_grad()` with `for x, y in val_dl` after each epoch, written out here; also after a refit, and
after a resume from a mid-epoch snapshot in a new trainer. data_order='global' keeps the (seed, epoch)
order (tests/test_exact_order.py); what happens when the rule changes is tested at the end."""

import shutil

import pytest
import torch
from test_exact_order import FailingLoss  # cross_entropy raising once, after the forward drew its dropout
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from deepepochs import ConfigError, SnapshotCallback, Trainer
from deepepochs.errors import DeepEpochsWarning
from deepepochs.parallel.strategy import select_policy

N, VAL_N, BATCH, EPOCHS = 48, 20, 4, 3  # 12 training batches per epoch, all of one size


class Noisy(Dataset):
    """Sample i with noise drawn from torch's generator when it is loaded (augmentation while loading: in
    the main process, or in a worker from its seed)."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]


def _model():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def _loaders(kind):
    """The user's training and validation DataLoaders: torch's global generator ('global'), a generator of
    their own ('generator'), or that with two worker processes ('workers')."""
    train, val = Noisy(N, 1), Noisy(VAL_N, 2)
    if kind == "global":
        return DataLoader(train, batch_size=BATCH, shuffle=True), DataLoader(val, batch_size=8)
    workers = 2 if kind == "workers" else 0
    g = torch.Generator().manual_seed(17)
    return (DataLoader(train, batch_size=BATCH, shuffle=True, generator=g, num_workers=workers),
            DataLoader(val, batch_size=8, num_workers=workers))


def plain_loop(kind):
    """The user's loop: SGD, k=1, fp32, validation after each epoch (its loader draws its base seed)."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train, val = _loaders(kind)
    for _ in range(EPOCHS):
        model.train()
        for x, y in train:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            for x, y in val:
                F.cross_entropy(model(x), y)
    return model.state_dict(), opt.state_dict()


def _trainer(loss=F.cross_entropy, callbacks=(), epochs=EPOCHS, **kw):
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(model, loss, opt, epochs=epochs, device="cpu", log_batch=False, show_info=False,
                      callbacks=list(callbacks), **kw)
    return trainer, model, opt


def _assert_equal(got, want):
    """Every weight and every optimizer tensor bit for bit."""
    for name, value in want[0].items():
        assert torch.equal(got[0][name], value), name
    assert got[1]["state"].keys() == want[1]["state"].keys()
    for index, state in want[1]["state"].items():
        for name, value in state.items():
            assert torch.equal(got[1]["state"][index][name], value), (index, name)


@pytest.fixture(scope="module", params=["global", "generator", "workers"])
def reference(request):
    return request.param, plain_loop(request.param)


def test_a_fit_trains_on_the_users_batches_and_ends_bit_identical_to_the_plain_loop(reference):
    """Same seed, shuffle, dropout, augmentation while loading, k=1, fp32, validation each epoch: the
    weights and the optimizer state equal the plain loop's bit for bit."""
    kind, want = reference
    trainer, model, opt = _trainer()
    trainer.fit(*_loaders(kind))
    trainer.close()
    _assert_equal((model.state_dict(), opt.state_dict()), want)


@pytest.mark.parametrize("fail_at", [3, 13, 25])
def test_a_refit_after_a_fault_still_ends_bit_identical_to_the_plain_loop(reference, fail_at):
    """A fault in the loss of batch 3 (epoch 1), 13 (epoch 2's first) or 25 (epoch 3's first), then fit
    again with the same loaders: the rollback and refit draw what the plain loop drew."""
    kind, want = reference
    trainer, model, opt = _trainer(FailingLoss(fail_at))
    train, val = _loaders(kind)
    with pytest.raises(RuntimeError, match="injected fault"):
        trainer.fit(train, val)
    torch.rand(99)  # what the user draws before refitting does not matter
    trainer.fit(train, val)
    trainer.close()
    _assert_equal((model.state_dict(), opt.state_dict()), want)


@pytest.mark.parametrize("name", ["snapshot-u000000005.ckpt", "snapshot-u000000017.ckpt",
                                  "snapshot-u000000012-epoch1.ckpt"])
def test_a_resume_from_a_snapshot_in_a_new_trainer_ends_bit_identical_to_the_plain_loop(tmp_path, reference, name):
    """Snapshots at every update; a new trainer (after other random draws) resumes from one inside epoch 1,
    inside epoch 2 or at epoch 1's end, and ends as the plain loop does."""
    kind, want = reference
    trainer, _, _ = _trainer(callbacks=[SnapshotCallback(tmp_path / "all", every_n_updates=1, keep=100)],
                             running_id="run")
    trainer.fit(*_loaders(kind))
    trainer.close()
    (tmp_path / "one" / "run").mkdir(parents=True)
    shutil.copy(tmp_path / "all" / "run" / name, tmp_path / "one" / "run" / name)
    trainer, model, opt = _trainer(callbacks=[SnapshotCallback(tmp_path / "one", every_n_updates=None)],
                                   running_id="run", resume=True)
    torch.manual_seed(1234)  # a new process draws other numbers before its fit
    train, val = _loaders(kind)
    trainer.fit(train, val)
    trainer.close()
    _assert_equal((model.state_dict(), opt.state_dict()), want)


def test_data_order_global_trains_on_another_order_than_the_plain_loop():
    """The option changes the order (the test above would fail with it): data_order='global' is DDP's."""
    want = plain_loop("global")
    trainer, model, _ = _trainer(data_order="global")
    trainer.fit(*_loaders("global"))
    trainer.close()
    assert not all(torch.equal(model.state_dict()[k], v) for k, v in want[0].items())


def test_a_bad_data_order_names_the_argument_the_accepted_values_and_what_came():
    with pytest.raises(ConfigError, match=r"data_order must be one of 'loader', 'global' \(got 'shuffled'\)"):
        _trainer(data_order="shuffled")


def test_data_order_loader_under_several_processes_is_refused(monkeypatch):
    """Several processes train on shards of the global order: asking for the loader's own is an error."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"data_order='loader' .* only one process .* has 2 processes.*"
                                          r"data_order='global'"):
        select_policy(torch.device("cpu"), data_order="loader")


@pytest.mark.parametrize(("written", "resumed", "message"), [
    ("loader", "global", r"trained on the DataLoader's own order .* this run trains in the global order"),
    ("global", "loader", r"this run trains on the DataLoader's own order .* was not kept"),
])
def test_resuming_inside_an_epoch_under_another_order_rule_warns(tmp_path, written, resumed, message):
    """A mid-epoch snapshot continues in the rule it was written with; resumed under the other rule (the
    option changed, or the world size: several processes train in the global order), the rest of the
    epoch follows another order, which a warning says."""
    snapshots = SnapshotCallback(tmp_path / "all", every_n_updates=5, keep=100)
    trainer, _, _ = _trainer(callbacks=[snapshots], running_id="run", data_order=written, epochs=1)
    trainer.fit(*_loaders("global"))
    trainer.close()
    (tmp_path / "one" / "run").mkdir(parents=True)
    shutil.copy(tmp_path / "all" / "run" / "snapshot-u000000005.ckpt", tmp_path / "one" / "run")
    trainer, _, _ = _trainer(callbacks=[SnapshotCallback(tmp_path / "one", every_n_updates=None)], running_id="run",
                             resume=True, data_order=resumed, epochs=1)
    with pytest.warns(DeepEpochsWarning, match=message):
        trainer.fit(*_loaders("global"))
    trainer.close()
