"""The accumulation window's counters are moved by spec actions only: `count_micro_batch` on each training
`begin_batch` edge counts a micro-batch, and `open_window` and the rollback's `reset_loop` empty a window
with the same function."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepepochs import Trainer
from deepepochs.engine import actions

SIZES = [5, 3, 4, 6, 2, 7, 1]  # ragged batches: windows of k=3 hold 12, 15 and 1 samples


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)) for n in SIZES]


def _trainer(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 2))
    return Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1, device="cpu",
                   log_batch=False, show_info=False, gradient_accumulation_steps=3, **kw)


@pytest.mark.parametrize("fuse_steps", [True, False])
def test_each_micro_batch_is_counted_in_its_window_by_the_begin_batch_action(monkeypatch, fuse_steps):
    """The spied `count_micro_batch` sees every micro-batch once, before it is counted (nothing counted it
    earlier), and leaves the window's position, samples and first size that the data give."""
    seen = []
    original = actions.ACTIONS["count_micro_batch"]

    def spy(ctx):
        loop = ctx.loop
        before = (loop.window_pos, loop.window_samples)
        original(ctx)
        seen.append((before, (loop.window_pos, loop.window_samples, loop.window_first_size)))

    monkeypatch.setitem(actions.ACTIONS, "count_micro_batch", spy)
    _trainer(fuse_steps=fuse_steps).fit(_data())
    expected, pos, samples, first = [], 0, 0, 0
    for i, n in enumerate(SIZES):  # windows of three batches, in data order
        if i % 3 == 0:
            pos, samples, first = 0, 0, n
        expected.append(((pos, samples), (pos + 1, samples + n, first)))
        pos, samples = pos + 1, samples + n
    assert seen == expected


class Interrupt(Exception):
    pass


def test_a_rollback_leaves_an_empty_window_like_a_freshly_opened_one():
    """After an exception inside a window the trainer's window is the one `open_window` makes: no
    position, samples, first size, update flags or finiteness left from the interrupted window."""
    trainer = _trainer()

    def fail(module, args):
        if trainer.loop.batch_idx == 5:
            raise Interrupt

    handle = trainer.raw_model[0].register_forward_pre_hook(fail)
    with pytest.raises(Interrupt):
        trainer.fit(_data())
    loop = trainer.loop
    assert (loop.window_pos, loop.window_samples, loop.window_first_size) == (0, 0, 0)
    assert not loop.window_updated and not loop.window_committed and loop.finite == {}
    handle.remove()
    trainer.fit(_data())
    assert trainer.loop.completed_epochs == 1
