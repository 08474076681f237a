"""The bad-input table. Each row feeds one mistake a user makes and asserts the exact message: it
names the argument (or the thing at fault), the accepted values and what was received, and nothing trains.
"""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from deepepochs import Callback, CheckCallback, CheckpointError, ConfigError, Optimizer, Trainer, rename
from deepepochs.training.precision import Precision

X = torch.randn(16, 4)
Y = (X[:, 0] > 0).long()
DATA = [(X[:8], Y[:8]), (X[8:], Y[8:])]


def _trainer(**kw):
    kw.setdefault("device", "cpu")
    t = Trainer(nn.Linear(4, 2), kw.pop("loss", F.cross_entropy), epochs=kw.pop("epochs", 1), log_batch=False,
                show_info=False, **kw)
    t._console.enabled = False
    return t


def _weights(t):
    return [p.detach().clone() for p in t.raw_model.parameters()]


class WrongSignature(Callback):
    def on_after_epoch(self, trainer):
        pass


def _corrupt_checkpoint(tmp_path):
    run = tmp_path / "ckpt" / "run-1"
    run.mkdir(parents=True)
    (run / "val-loss.best.ckpt").write_bytes(b"definitely not a torch file")
    return CheckCallback("loss", ckpt_dir=tmp_path / "ckpt")


def _plateau_without_loss():
    opt = torch.optim.SGD(nn.Linear(4, 2).parameters(), 0.1)
    return Optimizer(opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt))


ROWS = {
    "a ReduceLROnPlateau without the loss it watches": (
        lambda tmp: _plateau_without_loss(),
        ConfigError, r"a ReduceLROnPlateau scheduler steps with the loss it watches: pass"
                     r" Optimizer\(opt, scheduler, sched_with_loss=True\)"
                     r" \(got sched_on='epoch', sched_with_loss=False\)"),
    "unknown precision": (
        lambda tmp: _trainer(precision="half"),
        ConfigError, r"precision must be one of 'fp32', 'fp16', 'bf16' \(got 'half'\); use 'fp16'"),
    "non-positive accumulation steps": (
        lambda tmp: _trainer(gradient_accumulation_steps=0),
        ConfigError, r"gradient_accumulation_steps must be a positive int \(got 0\)"),
    "a misspelt DDP keyword argument": (
        lambda tmp: _trainer(ddp_kwargs={"find_unused_parameter": True}),
        ConfigError, r"ddp_kwargs has keys DistributedDataParallel does not take: \['find_unused_parameter'\];"
                     r" accepted keys: \[.*'find_unused_parameters'.*\]"),
    "a DDP keyword argument the trainer sets": (
        lambda tmp: _trainer(ddp_kwargs={"device_ids": [0]}),
        ConfigError, r"ddp_kwargs may not set \['device_ids'\]: the trainer sets the module, its device"),
    "DDP keyword arguments that are not a dict": (
        lambda tmp: _trainer(ddp_kwargs=["find_unused_parameters"]),
        ConfigError, r"ddp_kwargs must be None or a dict of DistributedDataParallel keyword arguments.*"
                     r"\(got \['find_unused_parameters'\]\)"),
    "a batch the rules cannot split": (
        lambda tmp: _trainer().fit([X]),
        ConfigError, r"cannot split a batch of type Tensor into inputs and a label.*pass loss=None"),
    "a metric returning a string": (
        lambda tmp: _trainer().test(DATA, metrics=[rename(lambda p, y: "high", "mood")]),
        ConfigError, r"metric 'mood' must return a number, a one-element tensor or a dict of them \(got str"),
    "a metric returning a non-scalar tensor": (
        lambda tmp: _trainer().test(DATA, metrics=[rename(lambda p, y: p, "raw")]),
        ConfigError, r"metric 'raw' must return a scalar, a 1-D tensor of per-class values or a dict of them"
                     r" \(got a tensor of shape \(8, 2\)\)"),
    "a loss that is not a scalar": (
        lambda tmp: _trainer(loss=lambda o, y: F.cross_entropy(o, y, reduction="none")).fit(DATA),
        ConfigError, r"the loss must be a scalar tensor \(got \(8,\)\); reduce it"),
    "a monitor on a missing metric": (
        lambda tmp: _trainer(callbacks=[CheckCallback("acc", ckpt_dir=tmp / "c")]).fit(DATA, DATA),
        ConfigError, r"CheckCallback monitor must name a val metric: one of 'loss' \(got 'acc'\)"),
    "resume naming a missing run": (
        lambda tmp: _trainer(callbacks=[CheckCallback("loss", ckpt_dir=tmp / "c")], resume="no-such-run").fit(DATA),
        CheckpointError, r"no-such-run"),
    "a corrupt checkpoint file": (  # resume='<run>' (resume=True skips it with a warning, test_checkpoint.py)
        lambda tmp: _trainer(callbacks=[_corrupt_checkpoint(tmp)], resume="run-1").fit(DATA),
        CheckpointError, r"cannot read checkpoint .*val-loss\.best\.ckpt"),
    "an empty DataLoader": (
        lambda tmp: _trainer().fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=32,
                                                               drop_last=True)),
        ConfigError, r"the train data of task 0 is empty \(len 0\)"),
    "a callback hook with the wrong signature": (
        lambda tmp: _trainer(callbacks=[WrongSignature()]),
        ConfigError, r"WrongSignature\.on_after_epoch\(trainer\) cannot take the hook's arguments \(trainer,"
                     r" train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx\)"),
    "an unknown metric_patch": (
        lambda tmp: _trainer(metric_patch="avg"),
        ConfigError, r"metric_patch must be one of 'auto', 'tensor', 'mean', 'confusion' \(got 'avg'\)"),
    "an optimizer that is not one": (
        lambda tmp: Trainer(nn.Linear(4, 2), F.cross_entropy, opt="adam"),
        ConfigError, r"opt must be None, a torch.optim.Optimizer, a deepepochs.Optimizer or a list of them"),
    "a negative epoch target": (
        lambda tmp: _trainer(epochs=-1),
        ConfigError, r"epochs must be a positive int, or None with max_updates=N \(got -1\)"),
    "an unavailable device": (
        lambda tmp: Trainer(nn.Linear(4, 2), F.cross_entropy, device="cuda:9" if not torch.cuda.is_available()
                            else "nonsense"),
        ConfigError, r"device"),
    "a console flag that is not a bool": (
        lambda tmp: Trainer(nn.Linear(4, 2), F.cross_entropy, log_tqdm="yes"),
        ConfigError, r"log_tqdm must be True or False \(got 'yes'\)"),
    "metrics that are not callables": (
        lambda tmp: _trainer(metrics=[1]),
        ConfigError, r"metrics must be a callable or a list of callables \(got int\)"),
    "a resume value of the wrong type": (  # an int is a run id, as in 0.6 (resume=3 names run '3')
        lambda tmp: _trainer(resume=3.0),
        ConfigError, r"resume must be False, True or a running id \(a string or an int\) \(got 3\.0\)"),
    "fit without data": (
        lambda tmp: _trainer().fit(),
        ConfigError, r"fit\(\) needs training data: pass train_dl or train_tasks"),
    "both train_dl and train_tasks": (
        lambda tmp: _trainer().fit(DATA, train_tasks=[__import__("deepepochs").EpochTask(DATA)]),
        ConfigError, r"pass either train_dl or train_tasks to fit\(\), not both"),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_bad_input_is_refused_with_a_clear_message(row, tmp_path):
    """Each mistake raises its documented error, and the trainer (when built) is idle with no epoch run."""
    action, error, message = ROWS[row]
    with pytest.raises(error, match=message):
        action(tmp_path)


def test_bf16_on_a_gpu_without_native_bf16_is_refused(monkeypatch):
    """Bf16 on an unsupported CUDA device names the device and the alternatives (simulated GPU)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Old GPU")
    with pytest.raises(ConfigError, match=r"precision='bf16' is not supported on cuda:0 \(Old GPU"):
        Precision("bf16", torch.device("cuda:0"))


def test_a_refused_fit_changes_nothing():
    """A fit refused for bad data leaves weights, epoch counter and machine state as they were."""
    t = _trainer()
    before = _weights(t)
    with pytest.raises(ConfigError):
        t.fit([X])
    assert t.machine.state == "idle" and t.loop.completed_epochs == 0
    for p, q in zip(t.raw_model.parameters(), before):
        assert torch.equal(p, q)
