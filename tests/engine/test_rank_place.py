"""A rank's place as its heartbeat reads it from another thread: the loop's counters, the callback the
training thread is in, and the collective named in the loop's words."""

import threading

import torch
from torch import nn
from torch.nn import functional as F

from deepepochs import Callback, Trainer
from deepepochs.engine import rank_place


class _Hold(Callback):
    """Holds the training thread in `on_before_train_batch` of the third batch until released."""

    def __init__(self):
        self.inside, self.release = threading.Event(), threading.Event()

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        if batch_idx == 2:
            self.inside.set()
            self.release.wait(30)


def _held_place(first_fit: bool = False) -> tuple:
    """(the place read while a fit waits in `_Hold`'s callback at batch 3, the flight record then, the trainer);
    with `first_fit`, a one-batch fit of 2 epochs runs before that fit (of a third epoch)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    hold = _Hold()
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2 if first_fit else 1,
                      device="cpu", callbacks=[hold], log_batch=False, show_info=False)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
    if first_fit:
        trainer.fit(data[:1])
    fit = threading.Thread(target=trainer.fit, args=(data,), kwargs={"epochs": 3} if first_fit else {})
    fit.start()
    try:
        assert hold.inside.wait(30)
        place = rank_place.reader(trainer._ctx, trainer._driver)()
        records = trainer._ctx.machine.records()
    finally:
        hold.release.set()
        fit.join(30)
    return place, records, trainer


def test_the_reader_names_the_callback_stage_epoch_update_and_batch_the_training_thread_is_in():
    """Read from another thread while fit waits in a callback at epoch 1, batch 3, before update 3."""
    place, _, trainer = _held_place()
    assert place["callback"] == "_Hold.on_before_train_batch"
    assert (place["stage"], place["epoch"], place["batch"], place["update"]) == ("train", 1, 3, 3)
    assert place["collective"] is None and place["state"]
    idle = rank_place.reader(trainer._ctx, trainer._driver)()
    assert idle["callback"] is None and idle["state"] == "idle"


def _code(filename: str, name: str):
    """A code object of function `name` as if defined in `filename`."""
    namespace = {}
    exec(compile(f"def {name}():\n    pass\n", filename, "exec"), namespace)
    return namespace[name].__code__


def test_a_collective_is_named_by_the_deepepochs_function_that_issued_it():
    """A stack through DDPPolicy.global_sum into torch's all_reduce is the sample-count all-reduce; one from
    user code keeps torch's name; a DDP backward that syncs is the gradient all-reduce, one that does not is
    no collective."""
    ours = _code("/x/deepepochs/parallel/ddp.py", "global_sum")
    c10d = _code("/x/torch/distributed/distributed_c10d.py", "all_reduce")
    user = _code("/x/train.py", "main")
    backward = _code("/x/torch/autograd/graph.py", "_engine_run_backward")
    assert rank_place._activity([user, ours, c10d], False) == (None, "sample-count all-reduce")
    assert rank_place._activity([user, c10d], False) == (None, "all_reduce (from user code)")
    assert rank_place._activity([ours, backward], True) == (None, "gradient all-reduce")
    assert rank_place._activity([ours, backward], False) == (None, None)


def test_the_place_carries_the_path_since_the_fit_started_numbered_from_it():
    """The held fit's place lists its transitions since the fit's start (where the ranks' paths start
    together), numbered from 0, the cold ones apart; they equal the flight record's last ones."""
    place, records, _ = _held_place(first_fit=True)  # the second fit's path starts after the first
    path = place["path"]
    entries = path["entries"]
    assert [entry[0] for entry in entries] == list(range(path["count"]))  # fewer than the flight record keeps
    assert [tuple(entry[1:]) for entry in entries] == [tuple(r) for r in records[-path["count"]:]]
    assert entries[0][3:] == ["idle", "fit", "fit_running"]
    assert [entry[4] for entry in path["cold"]] == ["fit", "next_epoch", "begin_train", "begin_task"]
    assert path["waiting_at"] is None
