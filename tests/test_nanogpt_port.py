"""A nanoGPT-shaped program ported to deepepochs as its author would write it, against its plain PyTorch loop
at the same seed, bit for bit: a small character GPT with dropout, AdamW with decay and no-decay parameter
groups, gradient clipping at 1.0, windows of 2 micro-batches, training batches drawn from torch's global
generator by an endless iterable (nanoGPT's `get_batch`), a cosine learning rate set by hand before every
update, and an evaluation before the first update and every M updates (nanoGPT's `iter_num % eval_interval
== 0`) whose batches are drawn from the same generator. Also stopped by a real SIGTERM in the middle of the
stream and resumed by a fresh trainer, ending with the same weights, optimizer state and records.

The plain loop is written out here: `for micro_step in range(k): x, y = next(batches); forward; backward`,
then clip, step, zero_grad; the port fetches each micro-batch right before its forward as that loop does,
so the data's draws and dropout's interleave alike.
"""

import math
import os
import signal

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from deepepochs import Callback, GradClipCallback, Preempted, SnapshotCallback, Trainer

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 4
CHARS = sorted(set(TEXT))
DATA = torch.tensor([CHARS.index(c) for c in TEXT])
TRAIN, VAL = DATA[: int(0.8 * len(DATA))], DATA[int(0.8 * len(DATA)):]
BLOCK, BATCH, EMBD, HEADS, LAYERS, DROPOUT = 8, 4, 16, 2, 2, 0.2
K, MAX_UPDATES, EVAL_INTERVAL, EVAL_ITERS = 2, 11, 4, 2
LR, MIN_LR, WARMUP = 1e-2, 1e-3, 3


def get_batch(split):
    """nanoGPT's: BATCH random windows of the split, drawn from torch's global generator."""
    data = TRAIN if split == "train" else VAL
    ix = torch.randint(len(data) - BLOCK, (BATCH,))
    return (torch.stack([data[i:i + BLOCK] for i in ix]), torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix]))


class Batches:
    """The training stream: endless, each batch drawn when it is fetched. Where it stands is torch's global
    generator, which a snapshot keeps and a resume puts back: its own state (the Stateful protocol) is empty,
    so a resume continues it from the snapshot instead of reading past the batches trained."""

    def __iter__(self):
        while True:
            yield get_batch("train")

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class EvalBatches:
    """nanoGPT's `estimate_loss` batches: EVAL_ITERS of the validation split, drawn when fetched."""

    def __iter__(self):
        for _ in range(EVAL_ITERS):
            yield get_batch("val")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(EMBD), nn.LayerNorm(EMBD)
        self.c_attn, self.c_proj = nn.Linear(EMBD, 3 * EMBD), nn.Linear(EMBD, EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD), nn.Dropout(DROPOUT))
        self.attn_dropout, self.resid_dropout = nn.Dropout(DROPOUT), nn.Dropout(DROPOUT)
        self.register_buffer("mask", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK))

    def attend(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in self.c_attn(x).split(EMBD, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = self.attn_dropout(F.softmax(att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf")), dim=-1))
        return self.resid_dropout(self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C)))

    def forward(self, x):
        x = x + self.attend(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(len(CHARS), EMBD), nn.Embedding(BLOCK, EMBD)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln_f, self.lm_head = nn.LayerNorm(EMBD), nn.Linear(EMBD, len(CHARS), bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.size(1))
        return self.lm_head(self.ln_f(self.blocks(self.drop(self.wte(idx) + self.wpe(pos)))))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def configure_optimizers(model):
    """nanoGPT's: matrices and embeddings decay, biases and LayerNorm weights do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))


def get_lr(it):
    """nanoGPT's cosine schedule with linear warm-up, for 0-based update `it`."""
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    ratio = (it - WARMUP) / (MAX_UPDATES - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def set_lr(opt, it):
    for group in opt.param_groups:
        group["lr"] = get_lr(it)


def seeded():
    torch.manual_seed(1337)
    model = GPT()
    return model, configure_optimizers(model)


def plain_loop():
    """The program's own loop: an evaluation at update 0 and every EVAL_INTERVAL updates (its batches drawn
    then), MAX_UPDATES updates of K micro-batches each, the learning rate set before each."""
    model, opt = seeded()
    batches = iter(Batches())
    points, losses = [], []
    for it in range(MAX_UPDATES):
        set_lr(opt, it)
        if it % EVAL_INTERVAL == 0:
            model.eval()
            total, count = 0.0, 0
            with torch.no_grad():
                for x, y in EvalBatches():
                    total, count = total + lm_loss(model(x), y).item() * len(y), count + len(y)
            model.train()
            points.append(it)
            losses.append(total / count)
        for _ in range(K):
            x, y = next(batches)
            (lm_loss(model(x), y) / K).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, {"updates": points, "loss": losses}


class CosineByHand(Callback):
    """The program's `lr = get_lr(iter_num)`, set after every batch for the update to come."""

    def __init__(self, opt):
        self.opt = opt

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if trainer.loop.run.updates < MAX_UPDATES:
            set_lr(self.opt, trainer.loop.run.updates)


class SigtermAt(Callback):
    """Stands in for a cluster's scheduler: SIGTERM to this process after update `at`."""

    def __init__(self, at):
        self.at = at

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if trainer.loop.run.updates == self.at and trainer.loop.window_pos == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def port(folder=None, *extra):
    model, opt = seeded()
    set_lr(opt, 0)
    callbacks = [GradClipCallback(1.0, norm_type=2), CosineByHand(opt), *extra]
    if folder is not None:
        callbacks.append(SnapshotCallback(ckpt_dir=folder))
    trainer = Trainer(model, lm_loss, opt, max_updates=MAX_UPDATES, gradient_accumulation_steps=K,
                      callbacks=callbacks, device="cpu", log_batch=False, show_info=False,
                      resume=folder is not None, running_id="nanogpt")
    return trainer, model, opt


def fit(trainer):
    return trainer.fit(Batches(), EvalBatches(), val_every_n_updates=EVAL_INTERVAL, val_at_start=True,
                       val_at_end=False)


def assert_same(model, opt, want_model, want_opt):
    for (name, a), b in zip(model.state_dict().items(), want_model.state_dict().values()):
        assert torch.equal(a, b), name
    got, want = opt.state_dict(), want_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for i, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][i][key], value), (i, key)


@pytest.mark.slow
def test_a_nanogpt_shaped_port_trains_bit_identically_to_its_plain_loop():
    """Weights, AdamW states (both groups) and the evaluations at updates 0, 4 and 8 equal the plain loop's
    bit for bit: clipping in model.parameters() order, micro-batches fetched just before their forwards."""
    want_model, want_opt, want_val = plain_loop()
    trainer, model, opt = port()
    with trainer:
        records = fit(trainer)
    assert records["val"] == want_val and want_val["updates"] == [0, 4, 8]
    assert_same(model, opt, want_model, want_opt)


@pytest.mark.slow
def test_a_nanogpt_shaped_port_stopped_by_sigterm_resumes_to_the_plain_loops_weights(tmp_path):
    """A SIGTERM after update 6 (inside the stream, between evaluations) stops the fit with a snapshot; a
    fresh trainer resuming it ends with the plain loop's weights, optimizer state and evaluations."""
    want_model, want_opt, want_val = plain_loop()
    trainer, _, _ = port(tmp_path, SigtermAt(6))
    with trainer:
        try:
            fit(trainer)
        except Preempted:
            pass
        else:
            raise AssertionError("the SIGTERM did not stop the fit")
        assert trainer.loop.run.updates == 6
    trainer, model, opt = port(tmp_path)
    with trainer:
        records = fit(trainer)
    assert records["val"] == want_val
    assert_same(model, opt, want_model, want_opt)
