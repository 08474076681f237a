"""Training by updates: `Trainer(max_updates=N)` and `fit(val_every_n_updates=M)` over an endless stream.

A character model in the shape of karpathy's makemore: every (3 previous characters, next character) pair
of a list of names, sampled with replacement from the sampler's own generator (an endless stream in
practice), an evaluation every M updates, the best validation checkpoint and snapshots; a first job is
preempted half-way by SIGTERM (sent here by a callback standing in for the cluster's scheduler): it stops
in the middle of the stream with a snapshot, and a second one resumes the run (`resume=True`) from that
update, drawing the very batches the first would have drawn, and trains on to the full budget.

Run: `python examples/28-training_by_updates.py` (or `--small` for a few seconds' run).
"""

import argparse
import os
import signal
import tempfile

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from deepepochs import Callback, CheckCallback, Preempted, SnapshotCallback, Trainer

BLOCK = 3
SYLLABLES = ("ka", "mo", "li", "sa", "ne", "ri", "ta", "lo", "mi", "an", "el", "jo")


def make_words():
    g = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(SYLLABLES), (600, 3), generator=g)
    lengths = torch.randint(1, 4, (600,), generator=g)
    return sorted({"".join(SYLLABLES[int(i)] for i in row[:n]) for row, n in zip(picks, lengths)})


def make_set(words, stoi):
    xs, ys = [], []
    for word in words:
        context = [0] * BLOCK
        for ch in word + ".":
            ix = stoi.get(ch, 0)
            xs.append(context)
            ys.append(ix)
            context = context[1:] + [ix]
    return TensorDataset(torch.tensor(xs), torch.tensor(ys))


class MLP(nn.Module):
    """makemore's MLP model: embeddings of the context's characters, one hidden layer."""

    def __init__(self, vocab, emb=16, hidden=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.net = nn.Sequential(nn.Linear(BLOCK * emb, hidden), nn.Tanh(), nn.Linear(hidden, vocab))

    def forward(self, x):
        return self.net(self.emb(x).flatten(1))


class TimeLimit(Callback):
    """Stands in for the cluster's scheduler: sends this process SIGTERM after update `at`."""

    def __init__(self, at):
        self.at = at

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if trainer.loop.run.updates == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a budget of a few dozen updates")
    args = parser.parse_args()
    budget, every = (41, 10) if args.small else (2001, 250)
    words = make_words()
    chars = sorted(set("".join(words)))
    stoi = {ch: i + 1 for i, ch in enumerate(chars)}
    train_set = make_set([w for i, w in enumerate(words) if i % 10], stoi)
    val_set = make_set(words[::10], stoi)
    val_dl = DataLoader(val_set, batch_size=512)

    def stream():
        g = torch.Generator().manual_seed(3)
        sampler = RandomSampler(train_set, replacement=True, num_samples=10**10, generator=g)
        return DataLoader(train_set, batch_size=32, sampler=sampler)

    with tempfile.TemporaryDirectory() as folder:
        def make_trainer(*extra):
            torch.manual_seed(42)
            model = MLP(len(chars) + 1)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
            callbacks = [CheckCallback("loss", on_stage="val", ckpt_dir=folder),
                         SnapshotCallback(ckpt_dir=folder, every_n_updates=every), *extra]
            return Trainer(model, F.cross_entropy, opt, max_updates=budget, callbacks=callbacks,
                           resume=True, running_id="names", log_batch=False)

        with make_trainer(TimeLimit(budget // 2)) as trainer:  # a job preempted half-way
            try:
                trainer.fit(stream(), val_dl, val_every_n_updates=every)
            except Preempted as stop:  # uncaught, the script would exit with status 143 (a requeue)
                print(f"preempted at update {trainer.loop.run.updates}: {stop.path.name}")
        with make_trainer() as trainer:  # the requeued job resumes the run to the full budget
            records = trainer.fit(stream(), val_dl, val_every_n_updates=every)
            print("validation points:", records["val"]["updates"])
            print("best validation loss:", min(records["val"]["loss"]))
            print("best checkpoint:", trainer.callbacks[0].path(trainer).name)


if __name__ == "__main__":
    main()
