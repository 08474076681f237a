"""Under the update clock (`Trainer(max_updates=N)`) the console counts updates, not batches: the progress
bar's count and total are the run's committed updates and the budget (reopened after each validation point
at the count reached), and a batch line reads `U 17/30`; read from the real output on a terminal."""

import contextlib
import io
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from deepepochs import Trainer
from deepepochs.reporting import console

X, Y = torch.randn(40, 6, generator=torch.Generator().manual_seed(1)), torch.arange(40) % 3
UPDATES, EVERY = 30, 7


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _fit(**options) -> str:
    """A fit of 30 updates of 2 batches over an endless-in-practice stream with a validation point every 7;
    what it printed on a terminal."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Linear(8, 3))
    sampler = RandomSampler(range(40), replacement=True, num_samples=10**6, generator=torch.Generator().manual_seed(2))
    out = _Terminal()
    with contextlib.redirect_stdout(out):
        trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), max_updates=UPDATES,
                          gradient_accumulation_steps=2, device="cpu", show_info=False, **options)
        trainer.fit(DataLoader(TensorDataset(X, Y), batch_size=4, sampler=sampler),
                    DataLoader(TensorDataset(X[:16], Y[:16]), batch_size=8), val_every_n_updates=EVERY)
        trainer.close()
    return out.getvalue()


def test_the_training_progress_bar_counts_updates_toward_max_updates():
    """Every training bar frame reads `n/30` with n at most 30 (60 batches ran); each bar opens at the updates
    committed so far: 0, then 7, 14, 21 and 28 after the validation points."""
    pytest.importorskip("tqdm")
    log = _fit(log_tqdm=True, log_batch=False)
    frames = re.findall(r"E 1  TRAIN:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)", log)
    assert frames, log[-2000:]
    assert {total for _, total in frames} == {str(UPDATES)}
    counts = [int(n) for n, _ in frames]
    assert max(counts) <= UPDATES
    assert [0, 7, 14, 21, 28] == [n for n in sorted(set(counts)) if n in (0, 7, 14, 21, 28)]
    assert re.search(r"\d+/30 \[[^]]*update", log)  # the rate is in updates


def test_a_batch_line_under_the_update_clock_shows_the_update_count(monkeypatch):
    """Batch lines (`log_batch=True` without a bar), refreshed at every batch here: `E 1  U <n>/30  TRAIN>
    loss: ...`, counts rising to 30 by windows of 2 batches, no training batch count."""
    monkeypatch.setattr(console, "REFRESH_S", 0.0)
    log = _fit(log_tqdm=False, log_batch=True)
    counts = [int(n) for n in re.findall(r"\rE 1  U (\d+)/30  TRAIN> loss: \d\.\d{4}", log)]
    assert counts and counts == sorted(counts) and counts[-1] == UPDATES
    assert set(range(1, UPDATES + 1)) <= set(counts)  # each update shown (after the window's first batch too)
    assert not re.search(r"B \d+\S*  TRAIN>", log)  # validation lines count their batches: `E 1  B 1/2  VAL>`


def test_the_epoch_line_under_the_update_clock_names_the_update_count_its_end_reached():
    """A budget of 6 updates over 4 batches an epoch (2 updates): each epoch's line reads `E <e>  U <n>/6
    TRAIN> ...` with n the updates committed at its end (2, 4, 6), the step the trackers log it at; the
    validation points keep their `U <n>/6  VAL>` lines."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    out = _Terminal()
    with contextlib.redirect_stdout(out):
        trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), max_updates=6,
                          gradient_accumulation_steps=2, device="cpu", show_info=False, log_batch=False)
        trainer.fit(DataLoader(TensorDataset(X[:16], Y[:16]), batch_size=4),
                    DataLoader(TensorDataset(X[:8], Y[:8]), batch_size=8), val_every_n_updates=3)
        trainer.close()
    log = out.getvalue()
    assert re.findall(r"^E (\d)  U (\d)/6  TRAIN> loss: \d\.\d{4}$", log, re.M) == [("1", "2"), ("2", "4"), ("3", "6")]
    assert re.findall(r"^U (\d)/6  VAL> loss", log, re.M) == ["3", "6"]
