"""An update zeroes only the gradients of the optimizers it stepped: the others add up until their turn, as
in a plain `opt.step(); opt.zero_grad()` loop, and a rollback puts them back as the last commit point kept
them (without what the discarded window added)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_optimize import make_dl, make_model  # a small regression set and model (tests/, on sys.path)
from test_rollback import Boom, RaiseInState  # raises once when the machine enters a state

from deepepochs import TrainerBase

QUIET = dict(log_batch=False, show_info=False, device="cpu")


def make_opts(model):
    """Optimizer 0 for the first layer (with momentum, so a wrong gradient history shows), 1 for the last."""
    return [torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9),
            torch.optim.SGD(model[2].parameters(), lr=0.02)]


class Alternating(TrainerBase):
    """One loss per batch; the batch's update steps one optimizer, the other one's gradients keep adding up."""

    def train_step(self, batch_x, batch_y, **step_args):
        self.n = getattr(self, "n", -1) + 1
        self.loss(self.model(batch_x), batch_y, do_optimize=False)
        self.optimize(self.n % 2)


def plain_loop(dl, epochs):
    """The same training by hand: backward every batch, step and zero one optimizer in turn."""
    model = make_model()
    opts = make_opts(model)
    n = 0
    for _ in range(epochs):
        for x, y in dl:
            F.mse_loss(model(x), y).backward()
            opts[n % 2].step()
            opts[n % 2].zero_grad()
            n += 1
    return model


def assert_same(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=f"{name}.grad")


def test_an_optimizer_that_did_not_step_keeps_adding_up_gradients_as_in_a_plain_loop():
    """Two epochs of alternating updates: weights and the gradients left at the end equal the plain loop's
    (optimizer 1's gradients of the last batch are still there)."""
    dl = make_dl(56)
    model = make_model()
    trainer = Alternating(model, F.mse_loss, make_opts(model), epochs=2, **QUIET)
    trainer.fit(dl)
    ref = plain_loop(dl, 2)
    assert_same(model, ref)
    assert any(p.grad is not None for p in model.parameters())  # the test would be empty otherwise
    trainer.close()


def test_a_later_fit_continues_from_the_kept_gradients_like_a_longer_plain_loop():
    """fit(epochs=1), then fit(epochs=3) (a total): the same as three epochs of the plain loop; gradients
    user code leaves between fits are dropped first."""
    dl = make_dl(56)
    model = make_model()
    trainer = Alternating(model, F.mse_loss, make_opts(model), epochs=1, **QUIET)
    trainer.fit(dl)
    kept = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    F.mse_loss(model(torch.randn(3, 4)), torch.randn(3, 1)).backward()  # user code between fits
    trainer.fit(dl, epochs=3)
    assert_same(model, plain_loop(dl, 3))
    assert any(k is not None for k in kept)
    trainer.close()


@pytest.mark.parametrize("state, batch", [
    ("step_backward", 4),  # the batch's loss is backpropagated; no update yet: the window is dropped
    ("step_backward", 5),
    ("optimize_unscaled", 4),  # half-way through the update
    ("optimize_clipped", 5),
    ("step_optimized", 4),  # the update is done and committed
    ("task_train", 5),
])
@pytest.mark.parametrize("fuse_steps", [False, True])
def test_a_rollback_puts_back_the_kept_gradients_without_the_discarded_windows_additions(state, batch, fuse_steps):
    """A fault at each point of an update in the second epoch, then a refit: the run ends as the
    uninterrupted plain loop does. After the fault the model holds what the last commit point kept: the
    plain loop's state after the batches that committed."""
    dl = make_dl(56)
    model = make_model()
    trainer = Alternating(model, F.mse_loss, make_opts(model), epochs=2, fuse_steps=fuse_steps,
                          callbacks=[RaiseInState(state, (2, batch))], **QUIET)
    trainer.n = -1
    with pytest.raises(Boom):
        trainer.fit(dl)
    committed = batch if state in ("step_optimized", "task_train") else batch - 1
    trainer.n = len(dl) + committed - 1  # the custom step's own counter is the user's: set it where the run is

    partial = make_model()
    opts = make_opts(partial)
    for n, (x, y) in enumerate([b for _ in range(2) for b in dl][:len(dl) + committed]):
        F.mse_loss(partial(x), y).backward()
        opts[n % 2].step()
        opts[n % 2].zero_grad()
    assert_same(model, partial)

    trainer.fit(dl)
    assert_same(model, plain_loop(dl, 2))
    trainer.close()


def test_a_mid_epoch_snapshot_carries_the_kept_gradients_to_a_resumed_run(tmp_path):
    """A snapshot after each update; a fresh trainer resuming from one written mid-epoch on an odd update (the
    second optimizer holds a batch's gradients then) ends as the uninterrupted plain loop does."""
    import shutil

    from deepepochs import SnapshotCallback

    dl = make_dl(56)
    model = make_model()
    first = Alternating(model, F.mse_loss, make_opts(model), epochs=2, running_id="run",
                        callbacks=[SnapshotCallback(tmp_path / "all", every_n_updates=1, keep=1000)], **QUIET)
    first.fit(dl)
    first.close()
    name = "snapshot-u000000003.ckpt"  # after batch 3 (optimizer 0 stepped): optimizer 1 keeps batch 3's
    (tmp_path / "one" / "run").mkdir(parents=True)
    shutil.copy(tmp_path / "all" / "run" / name, tmp_path / "one" / "run" / name)
    fresh = make_model(seed=7)
    resumed = Alternating(fresh, F.mse_loss, make_opts(fresh), epochs=2, running_id="run", resume=True,
                          callbacks=[SnapshotCallback(tmp_path / "one")], **QUIET)
    resumed.n = 2  # the custom step's own counter: three batches done
    resumed.fit(dl)
    assert_same(fresh, plain_loop(dl, 2))
    resumed.close()
