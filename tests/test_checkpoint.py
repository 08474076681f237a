"""Checkpoint files and resume: contents, atomic writes, finding and loading."""

import ast
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import deepepochs.checkpoint as ckpt_mod
from deepepochs import Callback, CheckCallback, CheckpointError, Optimizer, Trainer
from deepepochs.errors import DeepEpochsWarning

KEYS = {"format_version", "running_id", "epoch", "world_size", "model", "optimizers", "schedulers", "scaler",
        "history", "monitors", "rng", "order_seed", "position", "shards", "param_names", "averages",
        "updates", "carried", "callbacks"}


def _loader(n=64, batch_size=16, seed=0):
    """A fixed-order (shuffle=False) regression DataLoader."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(n, generator=g)
    return DataLoader(TensorDataset(x, y[:, None]), batch_size=batch_size, shuffle=False)


def _model_and_opt(seed=0, lr=0.05):
    """A small MLP, SGD with momentum and a StepLR, so optimizer and scheduler state both matter."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _trainer(tmp_path, epochs, resume=False, seed=0, callbacks=None, **kwargs):
    """A Trainer over `_model_and_opt` with one latest-epoch CheckCallback under tmp_path/ckpt."""
    model, opt, sched = _model_and_opt(seed)
    callbacks = callbacks if callbacks is not None else [
        CheckCallback("loss", save_best=False, ckpt_dir=tmp_path / "ckpt")]
    return Trainer(model, F.mse_loss, Optimizer(opt, sched), epochs=epochs, callbacks=callbacks,
                   resume=resume, log_batch=False, **kwargs)


def _reference(epochs, seed=0):
    """Plain PyTorch: the same model, optimizer, scheduler and data order, `epochs` epochs, no deepepochs."""
    model, opt, sched = _model_and_opt(seed)
    for _ in range(epochs):
        for x, y in _loader():
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        sched.step()
    return model, opt, sched


class EpochRecorder(Callback):
    """Records the 1-based index of every epoch that starts."""

    def __init__(self):
        self.epochs = []

    def on_before_epoch(self, trainer, train_tasks, val_tasks, epoch_idx):
        self.epochs.append(epoch_idx + 1)  # the hook's epoch_idx is 0-based


def _only_file(folder):
    files = list(folder.glob("*/*.ckpt"))
    assert len(files) == 1, files
    return files[0]


def test_resumed_run_trains_the_remaining_epochs_and_matches_an_uninterrupted_run(tmp_path):
    """3 epochs, then a fresh trainer with resume=True, epochs=5 runs epochs 4 and 5 only and ends where a
    plain 5-epoch PyTorch loop ends: same weights, momentum buffers, learning rate and schedule."""
    first = _trainer(tmp_path, epochs=3)
    first_records = first.fit(_loader(), _loader(seed=1))
    first.close()

    recorder = EpochRecorder()
    cb = CheckCallback("loss", save_best=False, ckpt_dir=tmp_path / "ckpt")
    resumed = _trainer(tmp_path, epochs=5, resume=True, seed=123, callbacks=[cb, recorder])
    records = resumed.fit(_loader(), _loader(seed=1))

    assert recorder.epochs == [4, 5]
    assert len(records["train"]["loss"]) == 5  # the whole run's records, the resumed epochs included
    assert records["train"]["loss"][:3] == first_records["train"]["loss"]
    assert resumed.running_id == first.running_id  # the run folder is reused
    model, opt, sched = _reference(5)
    for (name, got), want in zip(resumed.raw_model.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(got, want, msg=name)
    got_opt = resumed.opt[0].opt
    assert got_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** 2)
    assert resumed.opt[0].scheduler.last_epoch == sched.last_epoch == 5
    for p_got, p_want in zip(resumed.raw_model.parameters(), model.parameters()):
        want = opt.state[p_want]["momentum_buffer"]
        torch.testing.assert_close(got_opt.state[p_got]["momentum_buffer"], want)
    saved = torch.load(_only_file(tmp_path / "ckpt"), weights_only=True)
    assert saved["epoch"] == 5


def test_checkpoint_is_a_plain_dict_with_the_documented_keys_and_no_absolute_paths(tmp_path):
    """torch.load(weights_only=True) reads the file without deepepochs; keys and values are as documented."""
    trainer = _trainer(tmp_path, epochs=2)
    trainer.fit(_loader(), _loader(seed=1))
    data = torch.load(_only_file(tmp_path / "ckpt"), weights_only=True)

    assert set(data) == KEYS
    assert data["format_version"] == 1  # 2 only for mid-epoch snapshots (tests/test_snapshots.py)
    assert data["position"] is None and data["shards"] is None  # sharded folders: tests/distributed/test_fsdp.py
    assert data["averages"] is None  # without a weight average (tests/callbacks/test_averaging.py)
    assert data["epoch"] == 2 and data["world_size"] == 1 and data["running_id"] == trainer.running_id
    assert data["scaler"] is None
    assert list(data["model"]) == list(trainer.raw_model.state_dict())
    assert len(data["optimizers"]) == len(data["schedulers"]) == 1
    assert data["param_names"] == [[name for name, _ in trainer.raw_model.named_parameters()]]
    assert data["schedulers"][0]["last_epoch"] == 2
    assert set(data["monitors"]) == {"val-loss.latest"}
    assert set(data["rng"]) == {"python", "numpy", "torch", "cuda", "loaders", "streams"}
    assert data["rng"]["loaders"] == []  # the training DataLoader was given no generator of its own
    assert data["rng"]["streams"] == []  # nor streams from a stateful dataset
    assert data["order_seed"] == torch.initial_seed() % 2**62  # the seed of this process when fit began

    def strings(obj):
        if isinstance(obj, str):
            yield obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield from strings(k)
                yield from strings(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from strings(v)

    assert not [s for s in strings(data) if str(tmp_path) in s or os.sep + "ckpt" in s]


def test_a_failed_write_keeps_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    """torch.save failing half-way raises CheckpointError; the old file still loads and no temp file stays."""
    trainer = _trainer(tmp_path, epochs=1)
    trainer.fit(_loader(), _loader(seed=1))
    path = _only_file(tmp_path / "ckpt")
    before = path.read_bytes()

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(CheckpointError, match="writing checkpoint .*val-loss.latest.ckpt failed"):
        trainer.fit(_loader(), _loader(seed=1), epochs=2)
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert torch.load(path, weights_only=True)["epoch"] == 1
    # The folder holds the checkpoint and the first fit's run-end record (deepepochs.checkpoint.finished), no temp file.
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, "finished.pt"])


def test_a_process_killed_mid_save_leaves_the_last_good_checkpoint_for_resume(tmp_path):
    """A real SIGKILL during the second save: resume=True ignores the leftover temp file and loads epoch 1."""
    if not hasattr(os, "kill") or sys.platform == "win32":
        pytest.skip("needs POSIX signals")
    script = tmp_path / "victim.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        import torch.nn.functional as F
        from deepepochs import CheckCallback, Trainer
        x = torch.randn(32, 4); y = x.sum(1, keepdim=True)
        dl = DataLoader(TensorDataset(x, y), batch_size=8)
        cb = CheckCallback("loss", save_best=False, ckpt_dir={str(tmp_path / "ckpt")!r})
        trainer = Trainer(nn.Linear(4, 1), F.mse_loss, epochs=1, callbacks=[cb], log_batch=False)
        trainer.fit(dl, dl)
        real_save = torch.save
        def dying_save(obj, f, *a, **k):
            f.write(b"PK\\x03\\x04 partial")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = dying_save
        trainer.fit(dl, dl, epochs=2)
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == -9, result.stderr
    run = next((tmp_path / "ckpt").iterdir())
    leftovers = [p for p in run.iterdir() if p.name.startswith(".")]
    assert leftovers, "the killed writer should have left its temp file behind"
    os.utime(leftovers[0], (leftovers[0].stat().st_atime, leftovers[0].stat().st_mtime + 60))  # the newest

    model = nn.Linear(4, 1)
    cb = CheckCallback("loss", save_best=False, ckpt_dir=tmp_path / "ckpt")
    trainer = Trainer(model, F.mse_loss, epochs=2, callbacks=[cb], resume=True, log_batch=False)
    dl = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=8)
    records = trainer.fit(dl, dl)  # epoch 2 only trains: epoch 1 (and its records) came from the file
    assert len(records["train"]["loss"]) == 2 and trainer.loop.completed_epochs == 2
    assert trainer.running_id == run.name
    assert torch.load(run / "val-loss.latest.ckpt", weights_only=True)["epoch"] == 2


def test_a_moved_and_renamed_checkpoint_folder_resumes_into_the_renamed_run(tmp_path, capsys):
    """Moving ckpt_dir and renaming the run folder still resumes; new files go to the renamed folder."""
    first = _trainer(tmp_path, epochs=2)
    first.fit(_loader(), _loader(seed=1))
    old_run = tmp_path / "ckpt" / first.running_id
    shutil.move(str(tmp_path / "ckpt"), str(tmp_path / "moved"))
    (tmp_path / "moved" / first.running_id).rename(tmp_path / "moved" / "renamed-run")
    capsys.readouterr()

    cb = CheckCallback("loss", save_best=False, ckpt_dir=tmp_path / "moved")
    resumed = _trainer(tmp_path, epochs=3, resume=True, seed=7, callbacks=[cb])
    resumed.fit(_loader(), _loader(seed=1))

    assert "Resumed run renamed-run" in capsys.readouterr().out
    assert resumed.running_id == "renamed-run"
    assert not old_run.exists()
    saved = torch.load(tmp_path / "moved" / "renamed-run" / "val-loss.latest.ckpt", weights_only=True)
    assert saved["epoch"] == 3 and saved["running_id"] == "renamed-run"
    model, _, _ = _reference(3)
    for got, want in zip(resumed.raw_model.parameters(), model.parameters()):
        torch.testing.assert_close(got, want)


def test_load_checkpoint_loads_a_single_renamed_file_and_continues_from_its_epoch(tmp_path):
    """trainer.load_checkpoint(path) on a copied, renamed file restores weights, epoch and LR schedule."""
    first = _trainer(tmp_path, epochs=3)
    first.fit(_loader(), _loader(seed=1))
    copy = tmp_path / "elsewhere" / "my-model.ckpt"
    copy.parent.mkdir()
    shutil.copy(_only_file(tmp_path / "ckpt"), copy)

    fresh = _trainer(tmp_path, epochs=4, seed=5, callbacks=[])
    assert fresh.load_checkpoint(copy) is fresh  # chains, as in 0.6
    loaded = fresh.last_checkpoint
    assert loaded.epoch == 3 and fresh.loop.completed_epochs == 3
    for got, want in zip(fresh.raw_model.parameters(), first.raw_model.parameters()):
        assert torch.equal(got, want)
    assert fresh.opt[0].opt.param_groups[0]["lr"] == first.opt[0].opt.param_groups[0]["lr"]
    records = fresh.fit(_loader(), _loader(seed=1))
    assert len(records["train"]["loss"]) == 4  # the file's three epochs and the one trained now


def test_resume_with_a_missing_run_id_names_the_paths_searched(tmp_path):
    """resume='missing-run' raises CheckpointError listing <ckpt_dir>/missing-run; nothing ran."""
    trainer = _trainer(tmp_path, epochs=2, resume="missing-run")
    searched = re.escape(str(tmp_path / "ckpt" / "missing-run"))
    with pytest.raises(CheckpointError, match=r"resume='missing-run'.*searched " + searched):
        trainer.fit(_loader(), _loader(seed=1))
    assert trainer.loop.completed_epochs == 0 and trainer.machine.state == "idle"


def test_resume_with_a_run_id_picks_that_run_even_when_another_is_newer(tmp_path):
    """resume='<id>' restricts the search to that run's folders."""
    a = _trainer(tmp_path, epochs=1, running_id="run-a")
    a.fit(_loader(), _loader(seed=1))
    b = _trainer(tmp_path, epochs=2, running_id="run-b")
    b.fit(_loader(), _loader(seed=1))

    picked_a = _trainer(tmp_path, epochs=2, resume="run-a")
    picked_a.fit(_loader(), _loader(seed=1))
    assert picked_a.running_id == "run-a"
    newest = _trainer(tmp_path, epochs=2, resume=True)
    records = newest.fit(_loader(), _loader(seed=1))
    # Both runs are at epoch 2 now; the newest file's run (run-a) is finished: fit returns its records.
    assert records == picked_a.history and len(records["train"]["loss"]) == 2
    assert newest.running_id == "run-a"


def test_resume_true_without_any_checkpoint_starts_fresh_with_an_info_line(tmp_path, capsys):
    """A first run with resume=True trains from epoch 1 and says that no checkpoint was found."""
    recorder = EpochRecorder()
    cb = CheckCallback("loss", ckpt_dir=tmp_path / "ckpt")
    trainer = _trainer(tmp_path, epochs=2, resume=True, callbacks=[cb, recorder])
    trainer.fit(_loader(), _loader(seed=1))
    assert recorder.epochs == [1, 2]
    assert "no checkpoint found" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_an_unreadable_checkpoint_raises_checkpoint_error_naming_the_file(tmp_path, damage):
    """A corrupt or truncated file fails load_checkpoint and resume='<run>' with the path in the message;
    resume=True warns with the same message and starts fresh (a bad file never stops fit)."""
    first = _trainer(tmp_path, epochs=1)
    first.fit(_loader(), _loader(seed=1))
    path = _only_file(tmp_path / "ckpt")
    data = path.read_bytes()
    path.write_bytes(b"\x00not a checkpoint\xff" * 10 if damage == "garbage" else data[: len(data) // 2])

    resumed = _trainer(tmp_path, epochs=2, resume=path.parent.name)
    with pytest.raises(CheckpointError, match="cannot read checkpoint .*val-loss.latest.ckpt"):
        resumed.fit(_loader(), _loader(seed=1))
    with pytest.raises(CheckpointError, match="cannot read checkpoint .*val-loss.latest.ckpt"):
        _trainer(tmp_path, epochs=2).load_checkpoint(path)
    fresh = _trainer(tmp_path, epochs=2, resume=True)
    with pytest.warns(DeepEpochsWarning, match="skipped .*cannot read checkpoint .*val-loss.latest.ckpt"):
        records = fresh.fit(_loader(), _loader(seed=1))
    assert len(records["train"]["loss"]) == 2  # started fresh: both epochs trained


def test_a_checkpoint_from_a_newer_format_or_another_model_is_refused_clearly(tmp_path):
    """A future format_version and a state dict of another architecture raise CheckpointError."""
    first = _trainer(tmp_path, epochs=1)
    first.fit(_loader(), _loader(seed=1))
    data = torch.load(_only_file(tmp_path / "ckpt"), weights_only=True)
    torch.save({**data, "format_version": ckpt_mod.FORMAT_VERSION + 1}, tmp_path / "future.ckpt")
    with pytest.raises(CheckpointError, match=f"format_version {ckpt_mod.FORMAT_VERSION + 1}.*upgrade deepepochs"):
        _trainer(tmp_path, epochs=2).load_checkpoint(tmp_path / "future.ckpt")
    other = Trainer(nn.Linear(4, 1), F.mse_loss, epochs=2, log_batch=False)
    with pytest.raises(CheckpointError, match=r"does not fit this trainer; nothing was loaded: model keys differ"):
        other.load_checkpoint(_only_file(tmp_path / "ckpt"))


def test_model_states_with_ddp_or_compile_prefixes_load_into_the_plain_model(tmp_path):
    """`module.` (DDP) and `_orig_mod.` (torch.compile) prefixes are stripped when that makes keys match."""
    trainer = Trainer(nn.Linear(4, 1), F.mse_loss, epochs=1, log_batch=False)
    want = {k: torch.full_like(v, 0.25) for k, v in trainer.raw_model.state_dict().items()}
    for prefix in ("module.", "_orig_mod.", "module._orig_mod."):
        ckpt_mod.load_model_state(trainer, {prefix + k: v for k, v in want.items()})
        for k, v in trainer.raw_model.state_dict().items():
            assert torch.equal(v, want[k]), prefix


def test_fp16_grad_scaler_state_round_trips_through_a_checkpoint(tmp_path):
    """precision='fp16' on CPU: scale and growth tracker are saved, and restored by resume and by file."""
    first = _trainer(tmp_path, epochs=2, precision="fp16", device="cpu")
    first_records = first.fit(_loader(), _loader(seed=1))
    want = first.scaler.state_dict()
    saved = torch.load(_only_file(tmp_path / "ckpt"), weights_only=True)
    assert saved["scaler"] == want and want["_growth_tracker"] > 0  # trained: not a fresh scaler's state

    resumed = _trainer(tmp_path, epochs=2, resume=True, precision="fp16", device="cpu")
    assert resumed.scaler.state_dict() != want
    # Already at the target: the finished run only loads, and fit returns its records.
    assert resumed.fit(_loader(), _loader(seed=1)) == first_records
    assert resumed.scaler.state_dict() == want
    by_file = _trainer(tmp_path, epochs=2, precision="fp16", device="cpu", callbacks=[])
    by_file.load_checkpoint(_only_file(tmp_path / "ckpt"))
    assert by_file.scaler.state_dict() == want


_DDP_TARGET = """
import os
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from deepepochs import CheckCallback, Trainer

def main():
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    dl = DataLoader(TensorDataset(x, y), batch_size=8)
    cb = CheckCallback("loss", save_best=False, ckpt_dir=os.environ["DE_TEST_CKPT_DIR"])
    trainer = Trainer(nn.Linear(4, 1), F.mse_loss, epochs=2, callbacks=[cb], running_id="ddp-run",
                      log_batch=False, device="cpu")
    trainer.fit(dl, dl)
    state = {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}
    trainer.test(dl)  # every rank swaps in the same file's weights (after rank 0 finished writing)
    assert all(torch.equal(v, state[k]) for k, v in trainer.raw_model.state_dict().items())
    world_size = trainer.world_size
    trainer.close()
    return {"world_size": world_size, "state": state}
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_a_two_process_ddp_checkpoint_loads_in_a_single_process(tmp_path):
    """launch(num_processes=2) trains with a CheckCallback; one process loads the file and continues."""
    (tmp_path / "ddp_ckpt_target.py").write_text(_DDP_TARGET)
    runner = tmp_path / "run_ddp.py"
    runner.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import torch
        import ddp_ckpt_target
        from deepepochs import launch
        if __name__ == "__main__":
            torch.save(launch(ddp_ckpt_target.main, num_processes=2), {str(tmp_path / "result.pt")!r})
    """))
    env = {**os.environ, "DE_TEST_CKPT_DIR": str(tmp_path / "ckpt")}
    result = subprocess.run([sys.executable, str(runner)], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = torch.load(tmp_path / "result.pt", weights_only=True)
    if out["world_size"] != 2:
        pytest.skip("deepepochs.parallel.ddp has no DDP policy yet (the launched Trainer reported world size"
                    f" {out['world_size']}); this test needs one to write a world-size-2 checkpoint")
    path = tmp_path / "ckpt" / "ddp-run" / "val-loss.latest.ckpt"
    saved = torch.load(path, weights_only=True)
    assert saved["world_size"] == 2 and saved["epoch"] == 2
    trainer = Trainer(nn.Linear(4, 1), F.mse_loss, epochs=3, log_batch=False)
    trainer.load_checkpoint(path)
    for name, value in trainer.raw_model.state_dict().items():
        torch.testing.assert_close(value, out["state"][name], msg=name)
    x = torch.randn(16, 4)
    records = trainer.fit(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
    assert len(records["train"]["loss"]) == 3 and trainer.loop.completed_epochs == 3  # two from the file


class _Dropout(nn.Module):
    """Dropout and a shuffling DataLoader: both draw from the global torch generator every epoch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def _shuffled_run(tmp_path, epochs, resume=False):
    torch.manual_seed(1)
    model = _Dropout()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = Trainer(model, F.mse_loss, opt, epochs=epochs, resume=resume, log_batch=False, show_info=False,
                      callbacks=[CheckCallback("loss", on_stage="train", save_best=False,
                                               ckpt_dir=tmp_path / "ckpt")])
    loader = _loader()
    data = DataLoader(loader.dataset, batch_size=16, shuffle=True)
    trainer.fit(data)
    trainer.close()
    return trainer


@pytest.mark.parametrize("restore", [True, False])
def test_a_resumed_run_draws_the_same_random_numbers_as_an_uninterrupted_one(tmp_path, restore):
    """The checkpoint holds the generators' states: a run resumed in a fresh process (other random numbers
    drawn in between) shuffles and drops out as the uninterrupted run did, and ends with its weights.
    Without the states (the negative control) it does not."""
    reference = _shuffled_run(tmp_path / "ref", epochs=4)
    _shuffled_run(tmp_path / "cut", epochs=2)
    if not restore:
        path = _only_file(tmp_path / "cut" / "ckpt")
        data = torch.load(path, weights_only=True)
        data["rng"] = None
        torch.save(data, path)
    torch.rand(1000), random.random(), np.random.rand(7)  # a new process: the generators are elsewhere
    resumed = _shuffled_run(tmp_path / "cut", epochs=4, resume=True)
    assert resumed.loop.completed_epochs == 4
    same = all(torch.equal(a, b) for a, b in zip(resumed.raw_model.parameters(), reference.raw_model.parameters()))
    assert same is restore


def test_the_checkpoint_package_reads_the_trainers_public_dist_console_and_precision():
    """No module of deepepochs.checkpoint reads `trainer._dist`, `_console` or `_precision`: it uses the
    public `trainer.dist`, `.console` and `.precision`, so the facade keeps its privates to itself."""
    private = {"_dist", "_console", "_precision"}
    found, modules = [], sorted(Path(ckpt_mod.__file__).parent.glob("*.py"))
    for module in modules:
        for node in ast.walk(ast.parse(module.read_text(), str(module))):
            if (isinstance(node, ast.Attribute) and node.attr in private and isinstance(node.value, ast.Name)
                    and node.value.id == "trainer"):
                found.append(f"{module.name}:{node.lineno} trainer.{node.attr}")
    assert len(modules) >= 5  # the package's modules were read
    assert found == []


def test_the_user_guide_lists_every_key_a_checkpoint_file_holds():
    """docs/guide/checkpoints.md's key table names exactly the keys `torch.save` writes (no key undocumented,
    none documented that files lack)."""
    guide = Path(__file__).resolve().parents[1] / "docs" / "guide" / "checkpoints.md"
    table = guide.read_text().split("| key | content |", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", table, flags=re.M))
    assert documented == set(ckpt_mod.Checkpoint().to_dict()) == KEYS
