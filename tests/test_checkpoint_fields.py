"""Every leaf of every file the library writes into a run folder, damaged: a file is refused (or skipped by
resume=True) with the trainer unchanged, or it loads and the next fit trains to the end; nothing else.

Real fits of several configurations write their run folders (Adam; SGD with momentum; two optimizers; a
scheduler stepped per update; one stepped per epoch; mid-epoch snapshots; a sharded checkpoint folder; two
optimizers stepped in turn, so that snapshots keep the gradients of the one that did not step, over a
shuffled DataLoader with its own generator, so that they keep the sampler's and the loader's generator
states). The files are not listed here: every file the fits wrote that `torch.load(weights_only=True)`
reads is walked, and its leaves (a number, a string, a tensor, None, anywhere in the file; long lists of
numbers by their first two and last items) are what is damaged, so a field the writer adds is covered
without touching this test. A damage replaces one leaf (None, -1, 2**62, 'x', NaN, inf, [], {}, True, a 0-d
tensor, a tensor of another shape, a tensor of NaNs) and checks both routes: `load_checkpoint(path)` raises
`CheckpointError` naming the file and leaves the trainer as it was, or loads and `fit()` trains to its
epoch target; `resume=True` skips the file with a warning naming it and trains afresh, or resumes it and
trains to the end. A run's records (`finished.pt`, `progress.pt`) are damaged inside a copy of the whole
run folder and checked on the resume route.

In CI every leaf of every file is damaged once (the replacement rotating with the leaf);
`DEEPEPOCHS_FIELD_MUTATIONS=all` damages every leaf with every replacement (`make fields-full`). The
run-state fields a snapshot stores as they are and the DataLoaders' generator states, which a fit uses only
once it runs, get every replacement in CI too.
"""

from __future__ import annotations

import atexit
import copy
import functools
import math
import os
import re
import shutil
import tempfile
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoint_helpers import regression_batches, save_sharded
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import CheckCallback, Optimizer, SnapshotCallback, Trainer, TrainerBase, checkpoint
from deepepochs.checkpoint import run_rules
from deepepochs.engine import runstate
from deepepochs.errors import CheckpointError

EPOCHS = 2
ALL = os.environ.get("DEEPEPOCHS_FIELD_MUTATIONS", "") == "all"


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Dropout(0.2), nn.Linear(3, 1))


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)


def _two(model):
    return [torch.optim.Adam([*model[0].parameters(), *model[1].parameters()], lr=1e-2),
            torch.optim.SGD(model[4].parameters(), lr=0.01, momentum=0.5)]


def _per_step(model):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return Optimizer(opt, torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=6), sched_on="step")


def _per_epoch(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return Optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))


class InTurn(TrainerBase):
    """Two optimizers, one stepped per batch in turn: the other keeps its gradients to the next batch. The
    step writes what it carries (`self.carried`, never read back: its values are the user's own), so every
    file holds a carried state whose leaves are damaged too."""

    def train_step(self, batch_x, batch_y, **step_args):
        self.turn = 1 - getattr(self, "turn", 1)
        self.carried.update(turn=self.turn, last=batch_y[:2].clone(), pair=(self.turn, [batch_x.shape[0]]))
        self.loss(self.model(batch_x), batch_y, do_optimize=False)
        self.optimize(optimize_index=self.turn)


def _shuffled():
    """The regression samples (32) in a shuffled DataLoader of 4 batches with its own generator."""
    x = torch.cat([b[0] for b in regression_batches()])
    y = torch.cat([b[1] for b in regression_batches()])
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))


#: configuration: (optimizers, data, trainer class, whether snapshots are taken every update)
CONFIGS = {"adam": (_adam, regression_batches, Trainer, False),
           "sgd-momentum": (_sgd, regression_batches, Trainer, False),
           "two-optimizers": (_two, regression_batches, Trainer, False),
           "scheduler-per-step": (_per_step, regression_batches, Trainer, False),
           "scheduler-per-epoch": (_per_epoch, regression_batches, Trainer, False),
           "snapshots": (_adam, regression_batches, Trainer, True),
           "sharded": (_adam, regression_batches, Trainer, False),
           "in-turn-shuffled": (_two, _shuffled, InTurn, True)}


def _trainer(config: str, folder: Path, resume=False, every_update=False) -> Trainer:
    """A trainer of `config` writing into `folder`; its SnapshotCallback (if any) snapshots every update
    when `every_update` (the writing fit), else only at the epochs' ends (the checks: fewer writes)."""
    optimizers, _, cls, snapshots = CONFIGS[config]
    model = _model()
    callbacks = [CheckCallback("loss", on_stage="train", save_best=snapshots, ckpt_dir=folder)]  # +progress.pt
    if snapshots:
        callbacks.append(SnapshotCallback(folder, every_n_updates=1 if every_update else None, keep=100,
                                          on_signals=()))
    return cls(model, F.mse_loss, optimizers(model), epochs=EPOCHS, device="cpu", callbacks=callbacks,
               resume=resume, running_id="run", log_batch=False, show_info=False)


def _data(config: str):
    return CONFIGS[config][1]()


def _written_folder(config: str, folder: Path) -> Path:
    """The run folder a one-epoch fit of `config` wrote (with a sharded checkpoint folder for 'sharded')."""
    trainer = _trainer(config, folder, every_update=True)
    trainer.fit(_data(config), epochs=1)
    if config == "sharded":
        save_sharded(trainer, folder / "run" / "sharded.ckpt")
    trainer.close()
    return folder / "run"


def _readable(path: Path):
    """The file's contents when `torch.load(weights_only=True)` reads it, else None (a DCP shard, a log)."""
    try:
        return torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - not a file of this kind
        return None


def _leaves(obj, path=()):
    """The paths of every leaf of a loaded file (long lists of numbers: their first two and last items)."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        indices = range(len(obj))
        if len(obj) > 8 and all(not isinstance(v, (Mapping, list, tuple)) for v in obj):
            indices = (0, 1, len(obj) - 1)
        for i in indices:
            yield from _leaves(obj[i], (*path, i))
    else:
        yield path


def _get(obj, path):
    for key in path:
        obj = obj[key]
    return obj


def _set(obj, path, value):
    if not path:  # the file holds one value (a tensor): the damage replaces it
        return value
    if len(path) == 1:
        if isinstance(obj, tuple):
            return (*obj[:path[0]], value, *obj[path[0] + 1:])
        obj[path[0]] = value
        return obj
    inner = _set(obj[path[0]], path[1:], value)
    if isinstance(obj, tuple):
        return (*obj[:path[0]], inner, *obj[path[0] + 1:])
    obj[path[0]] = inner
    return obj


def _replacements(leaf):
    plain = [None, -1, 2**62, "x", math.nan, math.inf, [], {}, True]
    if isinstance(leaf, torch.Tensor):
        nan = torch.full_like(leaf, math.nan) if leaf.is_floating_point() else torch.zeros(7)
        return [*plain, torch.tensor(0.0), torch.zeros(7), nan]
    return plain


def _kind(name: str) -> str:
    """A written file's kind: its name without counters and random parts (`snapshot-u000000002.ckpt` and
    `snapshot-u000000003.ckpt` are one kind, `snapshot-u000000004-epoch1.ckpt` another)."""
    return re.sub(r"[0-9a-f]{8,}|\d+", "#", name)


def mutations(every_replacement: bool = ALL) -> list[tuple]:
    """The (configuration, file, leaf path, replacement index) to try. Each configuration's files are taken
    by kind (its first file of each), and each leaf of each is damaged: with `every_replacement` (the
    full run) with every replacement; else (CI) each field once over all configurations, a field being
    a file kind's leaf path with its numbers (list positions, optimizer state ids) generalized, with a
    replacement that rotates with the field."""
    out, seen = [], set()
    for config, files in written().items():
        kinds = {}
        for name in files:
            kinds.setdefault(_kind(name), name)
        for kind, name in kinds.items():
            data = files[name]
            for path in _leaves(data):
                leaf = _get(data, path)
                count = len(_replacements(leaf))
                if every_replacement:
                    out.extend((config, name, path, i) for i in range(count))
                    continue
                field = (kind, tuple("#" if isinstance(k, int) else k for k in path), type(leaf).__name__)
                if field not in seen:
                    seen.add(field)
                    out.append((config, name, path, zlib.crc32(repr(field).encode()) % count))
    return out


def _write_all(root: Path) -> dict:
    """Per configuration, its written files: {name relative to the run folder: contents}; the folders stay
    under `root` for the checks to copy."""
    out = {}
    for config in CONFIGS:
        run = _written_folder(config, root / config)
        files = {}
        for path in sorted(p for p in run.rglob("*") if p.is_file()):
            data = _readable(path)
            if data is not None:
                files[str(path.relative_to(run))] = data
        out[config] = files
    return out


_ROOT = Path(tempfile.gettempdir()) / f"deepepochs-fields-{os.getpid()}"


@functools.cache
def written() -> dict:
    """The files of every configuration's run (written once per process, under `_ROOT`)."""
    shutil.rmtree(_ROOT, ignore_errors=True)
    atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)
    return _write_all(_ROOT)


def _state(trainer) -> tuple:
    """What a refused load must leave as it was: weights, optimizer and scheduler states, counters, monitors."""
    return (copy.deepcopy(trainer.raw_model.state_dict()), copy.deepcopy(trainer.opt.state_dict()),
            trainer.loop.completed_epochs, trainer.loop.epoch,
            [copy.deepcopy(m.state_dict()) for m in checkpoint.monitors_of(trainer)], copy.deepcopy(trainer.history))


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _is_checkpoint(name: str) -> bool:
    return Path(name).parts[0].endswith(checkpoint.format.SUFFIX)


def _place(config: str, name: str, data, folder: Path) -> Path:
    """The damaged file `name` of `config`'s run under `folder/run`: a checkpoint as the run's only one (a
    sharded folder with its shards), a run record inside a copy of the whole run folder. Returns the path
    a load names (the checkpoint, or the record)."""
    source, run = _ROOT / config / "run", folder / "run"
    if _is_checkpoint(name):
        top = Path(name).parts[0]
        run.mkdir(parents=True)
        if (source / top).is_dir():
            shutil.copytree(source / top, run / top)
        torch.save(data, run / name)
        return run / top
    shutil.copytree(source, run, ignore=shutil.ignore_patterns("run.lock"))
    torch.save(data, run / name)
    return run / name


def outcome(config: str, name: str, path, index: int) -> str:
    """Damage leaf `path` of file `name` with replacement `index` and check both routes: 'refused' or
    'loaded'. Any other outcome (a load that makes the fit raise, a refusal that changed the trainer)
    raises AssertionError or the fit's exception."""
    data = written()[config][name]
    value = _replacements(_get(data, path))[index]
    damaged = _set(copy.deepcopy(data), path, value)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        target = _place(config, name, damaged, folder)
        refused = None
        if _is_checkpoint(name):
            trainer = _trainer(config, folder / "direct")
            before = _state(trainer)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    trainer.load_checkpoint(target)
                    refused = False
                except CheckpointError as e:
                    assert str(target) in str(e), f"the message names the file: {e}"
                    refused = True
                if refused:
                    assert _equal(_state(trainer), before), "a refused load changed the trainer"
                else:
                    trainer.fit(_data(config))
                    assert trainer.loop.completed_epochs >= EPOCHS
            trainer.close()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = _trainer(config, folder, resume=True)
            records = resumed.fit(_data(config))
            resumed.close()
        if refused is None:  # a run record: ignored with a warning or used; either way the fit ended well
            assert all(len(v) == resumed.loop.completed_epochs for v in records["train"].values())
            return "loaded"
        skipped = [w for w in caught if f"skipped {target}" in str(w.message)]
        if refused:
            assert skipped, f"resume=True did not say it skipped {target}"
            assert resumed.loop.completed_epochs == EPOCHS and len(records["train"]["loss"]) == EPOCHS
        else:
            assert not skipped and resumed.loop.completed_epochs >= EPOCHS
        return "refused" if refused else "loaded"


def test_the_written_files_hold_the_fields_the_damage_must_reach():
    """The fits write what the damage is meant to reach, so the walk cannot silently lose it: mid-epoch
    snapshots with kept gradients and the sampler's generator state, run records, a sharded folder."""
    names = {name for files in written().values() for name in files}
    assert {"finished.pt", "progress.pt", "train-loss.latest.ckpt", "train-loss.best.ckpt",
            f"sharded.ckpt/{checkpoint.shard_storage.SIDE_CAR}"} <= names
    snapshots = [data for name, data in written()["in-turn-shuffled"].items() if name.startswith("snapshot")]
    runs = [rank["run"] for data in snapshots if data["position"] for rank in data["position"]["ranks"]]
    assert any(run["grads"] is not None for run in runs), "no snapshot kept gradients"
    assert any(run["order_draws"]["fields"]["sampler"] is not None for run in runs), "no sampler generator state"
    files = [data for name, data in written()["in-turn-shuffled"].items() if _is_checkpoint(name)]
    assert files and all(set(data["carried"][0]["__dict__"]) == {"turn", "last", "pair"} for data in files)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_damaged_leaf_of_every_written_file_is_refused_unchanged_or_loads_and_trains_to_the_end(config):
    """Each leaf of each file `config`'s fit wrote, damaged: refused with the trainer unchanged (resume=True
    skips it with a warning and trains afresh) or loaded, after which fit trains to its epoch target."""
    cases = [m for m in mutations() if m[0] == config]
    failures = _failures(cases)
    assert not failures, f"{len(failures)} of {len(cases)} neither refused nor trained on:\n" + "\n".join(failures)


def _failures(cases) -> list[str]:
    """The damages of `cases` whose outcome is neither a refusal nor a fit trained to the end, each said."""
    failures = []
    for config, name, path, index in cases:
        try:
            outcome(config, name, path, index)
        except Exception as e:  # noqa: BLE001 - collected, then reported together
            value = _replacements(_get(written()[config][name], path))[index]
            failures.append(f"{name} {list(path)} <- {value!r}: {type(e).__name__}: {str(e)[:300]}")
    return failures


def _run_state_mutations() -> list[tuple]:
    """Every damage of the run-state fields a mid-epoch snapshot of 'in-turn-shuffled' stores (its kept
    gradients, the order draws with the sampler's generator state, the buffers) and of its DataLoader
    generator states (`rng['loaders']`)."""
    files = written()["in-turn-shuffled"]
    name = next(n for n, data in files.items() if n.startswith("snapshot") and data["position"] is not None)
    return [m for m in mutations(every_replacement=True)
            if m[:2] == ("in-turn-shuffled", name) and (m[2][:4] == ("position", "ranks", 0, "run")
                                                         or m[2][:2] == ("rng", "loaders"))]


def test_every_run_state_field_a_snapshot_stores_has_its_rule():
    """A field the run state stores as it is (a new one included) is checked before a resume applies it."""
    assert set(run_rules.RULES) == set(runstate.generic_fields(runstate.RunState()))


def test_every_damage_of_a_snapshots_run_state_and_loader_generators_is_refused_or_trains_on():
    """Each replacement of each kept gradient, order-draw field, buffer and DataLoader generator state:
    refused with the trainer unchanged, or loaded and trained to the end (before their rules, a damaged
    gradient or generator state loaded and then made the fit raise)."""
    cases = _run_state_mutations()
    paths = {m[2] for m in cases}
    assert all(any(word in p for p in paths) for word in ("grads", "sampler", "buffers", "loaders"))
    failures = _failures(cases)
    assert not failures, f"{len(failures)} of {len(cases)} neither refused nor trained on:\n" + "\n".join(failures)
