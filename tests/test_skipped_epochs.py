"""An epoch whose every update was skipped (nonfinite='skip' with a NaN in every window, an fp16 overflow)
keeps its place in the records: one entry per epoch in every history list, NaN for that epoch's training
values, its skip count on the console line; a loss-driven ReduceLROnPlateau steps with that NaN as a
plain PyTorch loop would, and CheckCallback(save_best=False) saves the epoch, so a requeued resume=True
continues after it. References are plain PyTorch loops."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, CheckCallback, Optimizer, Trainer

EPOCHS = 3


def data():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def mae(preds, targets):
    return (preds - targets).abs().mean()


class NaNInEpochs:
    """The mean squared error, NaN in every training batch of the epochs `bad` (1-based)."""

    def __init__(self, bad):
        self.bad, self.trainer = set(bad), None

    def __call__(self, out, target):
        loss = F.mse_loss(out, target)
        if self.trainer.loop.stage == "train" and self.trainer.loop.epoch in self.bad:
            return loss * math.nan
        return loss


def nan_trainer(bad, callbacks=(), resume=False, sched=False):
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loss = NaNInEpochs(bad)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5) if sched else None
    trainer = Trainer(net, loss, Optimizer(opt, plateau, sched_with_loss=True) if sched else opt, epochs=EPOCHS,
                      nonfinite="skip", metrics=[mae], callbacks=list(callbacks), resume=resume, running_id="run",
                      log_batch=False, show_info=False, device="cpu")
    loss.trainer = trainer
    return trainer, net, opt, plateau


def plain_loop(bad, sched=False):
    """Epochs `bad` apply no update; each epoch's training loss and MAE are sample-weighted over the batches
    of applied updates (NaN without any), then a ReduceLROnPlateau steps with the loss."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5) if sched else None
    history = {"loss": [], "mae": []}
    for epoch in range(1, EPOCHS + 1):
        loss_sum = mae_sum = count = 0.0
        for xb, yb in data():
            out = net(xb)
            if epoch in bad:
                continue
            loss = F.mse_loss(out, yb)
            loss_sum += loss.item() * len(xb)
            mae_sum += mae(out.detach(), yb).item() * len(xb)
            count += len(xb)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        history["loss"].append(loss_sum / count if count else math.nan)
        history["mae"].append(mae_sum / count if count else math.nan)
        if plateau is not None:
            plateau.step(history["loss"][-1])
    return net, history, plateau


def same_values(a, b):
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-6)
                                    for x, y in zip(a, b))


def test_an_epoch_without_an_applied_update_records_nan_in_every_list_and_its_skips_on_the_console(capsys):
    """Epoch 2 skips its 4 updates: every training list has 3 entries, NaN at epoch 2; the values and the
    weights are a plain loop's; the console line of epoch 2 shows NaN and '(4 updates skipped)'."""
    trainer, net, _, _ = nan_trainer({2})
    history = trainer.fit(data(), data())
    trainer.close()
    ref, ref_history, _ = plain_loop({2})
    assert {name: len(values) for name, values in history["train"].items()} == {"loss": 3, "mae": 3}
    assert len(history["val"]["loss"]) == 3
    for name in ("loss", "mae"):
        assert same_values(history["train"][name], ref_history[name]), name
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("E 2/3"))
    assert "TRAIN> loss: nan" in line and "(4 updates skipped)" in line


def test_a_loss_driven_plateau_scheduler_steps_with_the_skipped_epochs_nan_as_torch_does():
    """sched_with_loss=True without validation: the scheduler gets the training loss, NaN for the skipped
    epoch (torch counts it as an epoch without improvement); its state equals a plain loop's."""
    trainer, net, opt, plateau = nan_trainer({2}, sched=True)
    trainer.fit(data())
    trainer.close()
    ref, _, ref_plateau = plain_loop({2}, sched=True)
    got, expected = plateau.state_dict(), ref_plateau.state_dict()
    assert got["num_bad_epochs"] == expected["num_bad_epochs"] and got["_last_lr"] == expected["_last_lr"]
    assert got["best"] == pytest.approx(expected["best"], rel=1e-6)
    assert opt.param_groups[0]["lr"] == ref_plateau.optimizer.param_groups[0]["lr"] < 0.1


class FailInEpoch(Callback):
    def __init__(self, epoch):
        self.epoch = epoch

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if trainer.loop.epoch == self.epoch:
            raise RuntimeError("the job was killed")


def test_a_requeued_run_resumes_after_epochs_whose_updates_were_all_skipped(tmp_path):
    """CheckCallback(save_best=False) on the training loss saves epochs 1 and 2 (all skipped, NaN loss);
    the job dies in epoch 3; a new trainer with resume=True continues with epoch 3, not epoch 1, and ends
    with the plain loop's weights and one record per epoch."""
    def check():
        return CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=tmp_path)

    first, _, _, _ = nan_trainer({1, 2}, callbacks=[check(), FailInEpoch(3)])
    with pytest.raises(RuntimeError, match="the job was killed"):
        first.fit(data())
    first.close()
    requeued, net, _, _ = nan_trainer({1, 2}, callbacks=[check()], resume=True)
    history = requeued.fit(data())
    requeued.close()
    assert requeued.loop.completed_epochs == EPOCHS
    ref, ref_history, _ = plain_loop({1, 2})
    assert same_values(history["train"]["loss"], ref_history["loss"])
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_an_fp16_epoch_whose_every_update_overflows_keeps_its_entry_and_the_plain_gradscaler_weights(capsys):
    """fp16 on the CPU with a scale far too large: epoch 1's 16 updates all overflow (the scale halves
    each time), later ones apply; one NaN entry for epoch 1 and the weights of a plain GradScaler loop."""
    def scale(scaler):
        scaler.load_state_dict({"scale": 2.0 ** 40, "growth_factor": 2.0, "backoff_factor": 0.5,
                                "growth_interval": 2000, "_growth_tracker": 0})

    loader = DataLoader(data().dataset, batch_size=1)
    net = model()
    trainer = Trainer(net, F.mse_loss, torch.optim.SGD(net.parameters(), lr=0.05), epochs=EPOCHS, precision="fp16",
                      log_batch=False, show_info=False, device="cpu")
    scale(trainer.scaler)
    history = trainer.fit(loader)
    trainer.close()
    ref = model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    scale(scaler)
    applied = []
    for _ in range(EPOCHS):
        steps = 0
        for xb, yb in loader:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(ref(xb), yb)
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            steps += scaler.get_scale() >= before
            opt.zero_grad(set_to_none=True)
        applied.append(steps)
    assert applied[0] == 0 and applied[-1] > 0  # the case is reached: epoch 1 has no applied update
    assert len(history["train"]["loss"]) == EPOCHS and math.isnan(history["train"]["loss"][0])
    assert not any(math.isnan(v) for v in history["train"]["loss"][1:])
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("E 1/3"))
    assert "(16 updates skipped)" in line
