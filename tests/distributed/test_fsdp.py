"""`Trainer(strategy='fsdp')`: two gloo processes on the CPU with FSDP2 `fully_shard`.

The scenarios run in one `launch` (`fsdp_targets.run_scenarios`); each rank saves what it saw and the
tests compare it with references computed here: a plain PyTorch loop with the whole batch, a one-process
Trainer with the whole batch, metrics recomputed on the whole dataset at once, and the checkpoint files
read back with `torch.load`. The launch has a deadline, after which its processes are killed.
"""

import math
import os
import pickle
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.fsdp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.nn import functional as F
from torch.utils.data import DataLoader

from deepepochs import AnalyzeCallback, CheckCallback, SnapshotCallback, Trainer
from deepepochs.checkpoint import consolidate, read_checkpoint
from deepepochs.checkpoint import shard_storage as sharded
from deepepochs.errors import CheckpointError, DeepEpochsWarning

TARGETS_DIR = Path(__file__).resolve().parent
if str(TARGETS_DIR) not in sys.path:
    sys.path.insert(0, str(TARGETS_DIR))

if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6", allow_module_level=True)

import ddp_targets as T  # noqa: E402  (needs the sys.path entry above)
import fsdp_targets as S  # noqa: E402
from deadline import TORCHRUN_VARIABLES, launch_scenarios, teardown_abort  # noqa: E402

REPO = TARGETS_DIR.parents[1]
EXACT = 1e-5  # fp32 weights within float tolerance of the one-process run with the whole batch


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def ranks(out_dir):
    """What rank 0 and rank 1 recorded in `fsdp_targets.run_scenarios`."""
    launch_scenarios(S.run_scenarios, T.OUT_ENV, out_dir, seconds=240)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


# ---- references computed here ------------------------------------------------------------------------
def plain_reference(k: int, epochs: int = T.EPOCHS, clip: float | None = None) -> tuple[dict, dict]:
    """Plain PyTorch, one process, batch 2 * BATCH, windows of k batches (each window's loss is the mean over
    its samples), optionally clipping the gradients' total L2 norm: (weights, optimizer state)."""
    x, y = T.make_data(T.TRAIN_N, 1).tensors
    model = T.make_model()
    opt = T.make_optimizer(model)
    size = 2 * T.BATCH * k
    for _ in range(epochs):
        for start in range(0, T.TRAIN_N, size):
            window = slice(start, min(start + size, T.TRAIN_N))
            F.cross_entropy(model(x[window]), y[window]).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return model.state_dict(), opt.state_dict()


@pytest.fixture(scope="module")
def one_process():
    """The default Trainer in this process with batch 2 * BATCH (k = 1 and 3): its validation records."""
    records = {}
    for k in (1, 3):
        model = T.make_model()
        with Trainer(model, F.cross_entropy, T.make_optimizer(model),
                     **T.trainer_kwargs(gradient_accumulation_steps=k)) as trainer:
            records[k] = trainer.fit(DataLoader(T.make_data(T.TRAIN_N, 1), batch_size=2 * T.BATCH), S.val_loader())
    return records


# ---- equivalence with one process (FSDP's twin of DDP's same-weights test) ---------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize(("scenario", "k", "clip"), [("k1", 1, None), ("k3", 3, None), ("clip", 1, S.CLIP)])
def test_fsdp_weights_equal_one_process_with_the_whole_batch(ranks, scenario, k, clip):
    """World size 2 x batch b under FSDP = plain PyTorch with batch 2b: k=1, k=3 (windows 3+2) and global
    norm clipping of the sharded gradients; both ranks end with the same full weights."""
    reference, _ = plain_reference(k, clip=clip)
    for rank in ranks:
        assert rank[scenario]["policy"] == "FSDPPolicy"
        assert T.max_diff(rank[scenario]["state"], reference) < EXACT
    assert T.max_diff(ranks[0][scenario]["state"], ranks[1][scenario]["state"]) == 0.0


@pytest.mark.distributed
def test_clipping_changes_the_fsdp_result(ranks):
    """The clipped run differs from the unclipped one: the clip bound is active, so the equality above
    checks the global norm of the sharded gradients, not a no-op."""
    assert T.max_diff(ranks[0]["clip"]["state"], ranks[0]["k1"]["state"]) > 1e-3


@pytest.mark.distributed
@pytest.mark.parametrize(("scenario", "syncs"), [("k1", 5), ("k3", 2), ("k3_fallback", 5)])
def test_gradients_are_reduce_scattered_only_on_the_updating_micro_batch(ranks, scenario, syncs):
    """Gradient accumulation under FSDP: 5 batches per epoch, windows 3+2 with k=3, so 2 reduce-scatters per sharded
    parameter group and epoch instead of 5 (set_requires_gradient_sync, driven by the spec's actions).
    Without torch_private's FSDP records the fallback syncs every micro-batch, with the same weights."""
    for rank in ranks:
        run = rank[scenario]
        assert run["fsdp_modules"] == 3 and run["param_groups"] == 2  # two Linear layers, then the root
        assert run["reduce_scatters"] == syncs * T.EPOCHS * run["param_groups"]
    reference, _ = plain_reference(3 if scenario.startswith("k3") else 1)
    assert T.max_diff(ranks[0][scenario]["state"], reference) < EXACT


# ---- evaluation: equal forwards on every rank, each sample counted once -----------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize(("scenario", "k"), [("k1", 1), ("k3", 3)])
def test_validation_metrics_under_fsdp_equal_the_single_process_metrics(ranks, one_process, scenario, k):
    """37 validation samples over 2 ranks (4 and 3 batches: rank 1 runs a padding forward, recorded
    nowhere): every epoch's metrics as in one process, each sample counted once."""
    T.check_val_records(ranks, scenario, one_process[k]["val"], EXACT)


@pytest.mark.distributed
def test_test_and_predict_under_fsdp_see_every_sample_once(ranks):
    """test() = loss/accuracy of the final weights over all 37 samples at once; predict() returns every
    sample's output in dataset order on rank 0 and None on rank 1."""
    x, y = T.make_data(T.VAL_N, 2).tensors
    state = ranks[0]["k1"]["state"]
    expected = T.metrics_on(state, x, y)
    model = T.make_model()
    model.load_state_dict(state)
    with torch.no_grad():
        outputs = model(x)
    for rank in ranks:
        assert rank["k1"]["test"] == pytest.approx(expected, abs=EXACT)
    assert ranks[0]["k1"]["predict"].shape == outputs.shape
    assert float((ranks[0]["k1"]["predict"] - outputs).abs().max()) < EXACT
    assert ranks[1]["k1"]["predict"] is None


@pytest.mark.distributed
def test_uneven_evaluation_data_without_a_length_or_with_an_empty_shard_does_not_hang(ranks):
    """Shards of 3 and 2 batches without a length (agreed batch by batch), and a one-sample test set
    (rank 1 has no batch and pads with the dataset's first sample): global metrics over exactly the real
    samples, prediction of the one sample on rank 0."""
    x, y = T.make_data(T.VAL_N, 2).tensors
    state = ranks[0]["uneven_eval"]["state"]
    batches = [b for r in range(2) for b in S.uneven_batches(r)]
    union = T.metrics_on(state, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    single = T.metrics_on(state, x[5:6], y[5:6])
    model = T.make_model()
    model.load_state_dict(state)
    with torch.no_grad():
        output = model(x[5:6])
    for rank in ranks:
        run = rank["uneven_eval"]
        assert run["without_length"] == pytest.approx(union, abs=EXACT)
        assert run["one_sample"] == pytest.approx(single, abs=EXACT)
    assert float((ranks[0]["uneven_eval"]["predict_one"] - output).abs().max()) < EXACT
    assert ranks[1]["uneven_eval"]["predict_one"] is None


# ---- rollback under FSDP -----------------------------------------------------------------------------------
@pytest.mark.distributed
def test_a_fault_mid_window_rolls_back_exactly_under_fsdp(ranks):
    """Both ranks raise after the 2nd micro-batch's backward of a k=3 window (its unsynced gradients are
    inside FSDP); fit() again continues from the last commit point and ends with the uninterrupted run's
    weights, equal to one process with the whole batch."""
    reference, _ = plain_reference(3)
    for rank in ranks:
        run = rank["fault"]
        assert run["error"] == "injected fault mid-window"
        assert run["raised"] == [(S.FAULT_EPOCH, 2)]
        assert T.max_diff(run["state"], rank["k3"]["state"]) == 0.0
        assert T.max_diff(run["state"], reference) < EXACT
        assert len(run["records"]["train"]["loss"]) == T.EPOCHS  # the whole run: the refit trained epochs 2 and 3


# ---- the skip edge: a non-finite update on one rank is skipped on every rank ------------------------------
@pytest.mark.distributed
def test_a_nan_loss_on_one_rank_skips_that_update_on_both_like_one_process(ranks):
    """nonfinite='skip', fp32: rank 1's first batch holds a NaN sample; the agreed flag skips that window's
    update on both ranks every epoch, which is what one process with the whole batch skips."""
    x, y = S.data_with(math.nan).tensors
    model = T.make_model()
    opt = T.make_optimizer(model)
    for _ in range(T.EPOCHS):
        for start in range(0, T.TRAIN_N, 2 * T.BATCH):
            loss = F.cross_entropy(model(x[start:start + 2 * T.BATCH]), y[start:start + 2 * T.BATCH])
            loss.backward()
            if math.isfinite(loss.item()):
                opt.step()
            opt.zero_grad()
    for rank in ranks:
        assert T.max_diff(rank["skipped"]["fp32"], model.state_dict()) < EXACT


@pytest.mark.distributed
def test_an_fp16_overflow_on_one_rank_skips_on_both_and_halves_both_scales(ranks):
    """precision='fp16': rank 1's first batch overflows fp16 each epoch; the GradScaler's check over the
    sharded gradients finds it on both ranks, both skip and halve the scale once per epoch (65536 / 2**3),
    and the weights stay equal on both ranks."""
    for rank in ranks:
        run = rank["skipped"]["fp16"]
        assert run["scale"] == 65536.0 / 2 ** T.EPOCHS
        assert all(math.isfinite(v) for v in run["records"]["train"]["loss"])
    assert T.max_diff(ranks[0]["skipped"]["fp16"]["state"], ranks[1]["skipped"]["fp16"]["state"]) == 0.0
    assert T.max_diff(ranks[0]["skipped"]["fp16"]["state"], T.make_model().state_dict()) > 1e-3  # it trained


# ---- checkpoints: sharded folders, loadable at any world size, consolidated to one file -----------------
def _check_full_states(saved: dict, weights: dict, opt_state: dict) -> None:
    """`saved` (a checkpoint file's dict) holds the whole model and the optimizer's state keyed by parameter
    index with full momentum buffers, equal to the reference's."""
    assert {k: tuple(v.shape) for k, v in saved["model"].items()} == {k: tuple(v.shape) for k, v in weights.items()}
    assert T.max_diff(saved["model"], weights) < EXACT
    (optimizer,) = saved["optimizers"]
    assert sorted(optimizer["state"]) == sorted(opt_state["state"]) == [0, 1, 2, 3]
    assert [g["params"] for g in optimizer["param_groups"]] == [g["params"] for g in opt_state["param_groups"]]
    for index, state in opt_state["state"].items():
        assert optimizer["state"][index]["momentum_buffer"].shape == state["momentum_buffer"].shape
        assert float((optimizer["state"][index]["momentum_buffer"] - state["momentum_buffer"]).abs().max()) < EXACT


@pytest.mark.distributed
def test_a_two_process_fsdp_checkpoint_is_a_folder_of_each_ranks_shards(ranks, out_dir):
    """The epoch-2 checkpoint is a folder: checkpoint.pt without tensors, and DCP shards where each rank wrote
    its own part of every parameter (nothing gathered on rank 0)."""
    path = out_dir / "checkpoints" / "last" / S.RUN_ID / "train-loss.latest.ckpt"
    assert ranks[0]["checkpoint"]["last_file"] == str(path)
    side = torch.load(path / "checkpoint.pt", weights_only=True)
    assert side["format_version"] == 3 and side["epoch"] == 2 and side["world_size"] == 2 and side["model"] == {}
    assert not [v for state in side["optimizers"][0]["state"].values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    (folder,) = [p for p in path.iterdir() if p.is_dir()]
    assert folder.name == side["shards"]["folder"]
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    storage = sharded._reader(folder).read_metadata().storage_data
    for name in T.make_model().state_dict():
        files = {info.relative_path for index, info in storage.items() if index.fqn == f"model/{name}"}
        assert files == {"__0_0.distcp", "__1_0.distcp"}, name  # both ranks wrote a part of it


@pytest.mark.distributed
def test_consolidating_a_two_process_checkpoint_gives_one_file_of_full_states(ranks, out_dir, tmp_path):
    """consolidate() and `python -m deepepochs consolidate` write the plain one-file format: the whole model
    (the ranks' weights, the one-process keys and shapes) and full optimizer states keyed by parameter index,
    equal to a one-process run's after 2 epochs; the file loads with torch.load(weights_only=True)."""
    path = out_dir / "checkpoints" / "last" / S.RUN_ID / "train-loss.latest.ckpt"
    target = consolidate(path, tmp_path / "one.ckpt")
    saved = torch.load(target, weights_only=True)
    assert saved["format_version"] == 1 and saved["shards"] is None
    assert saved["epoch"] == 2 and saved["world_size"] == 2
    assert T.max_diff(saved["model"], ranks[0]["checkpoint"]["saved"]) == 0.0
    _check_full_states(saved, *plain_reference(1, epochs=2))
    result = subprocess.run([sys.executable, "-m", "deepepochs", "consolidate", str(path), str(tmp_path / "cli.ckpt")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    by_cli = torch.load(tmp_path / "cli.ckpt", weights_only=True)
    assert T.max_diff(by_cli["model"], saved["model"]) == 0.0
    assert by_cli["optimizers"][0]["param_groups"] == saved["optimizers"][0]["param_groups"]


@pytest.mark.distributed
def test_consolidate_refuses_what_is_not_a_sharded_checkpoint(ranks, out_dir, tmp_path):
    """A single file, a folder without checkpoint.pt, and a missing path: a one-line error, exit status 2."""
    path = out_dir / "checkpoints" / "last" / S.RUN_ID / "train-loss.latest.ckpt"
    one = consolidate(path, tmp_path / "one.ckpt")
    with pytest.raises(CheckpointError, match="single checkpoint file already"):
        consolidate(one, tmp_path / "again.ckpt")
    (tmp_path / "empty.ckpt").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint.pt"):
        consolidate(tmp_path / "empty.ckpt", tmp_path / "x.ckpt")
    result = subprocess.run([sys.executable, "-m", "deepepochs", "consolidate", str(tmp_path / "missing"),
                             str(tmp_path / "x.ckpt")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "x.ckpt").exists()


@pytest.mark.distributed
def test_shard_metadata_that_would_run_code_is_refused(ranks, out_dir, tmp_path):
    """DCP unpickles .metadata with pickle.load; deepepochs reads it with an allow-list, so a crafted
    file naming another global (here os.system) is refused before anything runs."""
    source = out_dir / "checkpoints" / "last" / S.RUN_ID / "train-loss.latest.ckpt"
    path = tmp_path / "crafted.ckpt"
    shutil.copytree(source, path)
    (folder,) = [p for p in path.iterdir() if p.is_dir()]
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"refers to (posix|nt)\.system"):
        read_checkpoint(path)
    assert not marker.exists()


@pytest.mark.distributed
def test_resuming_a_two_process_checkpoint_with_two_processes_continues_exactly(ranks):
    """resume= with 2 processes from the epoch-2 checkpoint (sharded folder, and consolidated to one file)
    trains epoch 3 only and ends as the uninterrupted 3-epoch run (model and momentum restored on every
    shard)."""
    reference, _ = plain_reference(1)
    for rank in ranks:
        run = rank["checkpoint"]
        assert len(run["resumed_records"]["train"]["loss"]) == 3  # epochs 1-2 from the checkpoint, 3 trained
        assert T.max_diff(run["resumed"], reference) < EXACT
        assert T.max_diff(run["from_file"], reference) < EXACT  # the consolidated single file, likewise
        assert T.max_diff(run["ddp_resumed"], reference) < EXACT  # and the folder, by a 2-process DDP trainer
        assert len(run["from_file_records"]["train"]["loss"]) == 3
    assert ranks[0]["checkpoint"]["from_file_saved_as_folder"]  # the epoch-3 save replaced the file by a folder
    assert ranks[0]["checkpoint"]["ddp_saved_as_file"]  # and DDP's, the folder by a file
    # the epoch-3 save removed the shard folder a killed save had left, and the one it replaced
    folder = ranks[0]["checkpoint"]["resumed_folder"]
    assert len(folder) == 2 and folder[0] == "checkpoint.pt" and folder[1].startswith("shards-")
    assert folder[1] != "shards-000000000000"


@pytest.mark.distributed
def test_resuming_a_two_process_checkpoint_in_one_process_continues_exactly(ranks, out_dir, tmp_path,
                                                                             monkeypatch):
    """The same file resumed by a one-process Trainer with the whole batch ends as the uninterrupted run."""
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(out_dir / "checkpoints" / "resume-1", ckpt_dir)
    model = T.make_model()
    monitor = CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=ckpt_dir)
    with Trainer(model, F.cross_entropy, T.make_optimizer(model), resume=S.RUN_ID,
                 **T.trainer_kwargs(callbacks=[monitor])) as trainer:
        records = trainer.fit(DataLoader(T.make_data(T.TRAIN_N, 1), batch_size=2 * T.BATCH))
        state = trainer.raw_model.state_dict()
    assert len(records["train"]["loss"]) == 3 and trainer.loop.completed_epochs == 3
    reference, _ = plain_reference(1)
    assert T.max_diff(state, reference) < EXACT


@pytest.mark.distributed
def test_a_two_process_checkpoint_resumes_with_three_fsdp_processes(ranks, out_dir, tmp_path):
    """DCP reshards on load: 3 processes (each holding a third of every parameter, cut where the 2-process
    save did not cut) load the epoch-2 checkpoint to exactly the saved weights, then train epoch 3 with a
    global batch of 12 as one process does with batch 12 from the consolidated file (momentum included)."""
    source = out_dir / "checkpoints" / "last"
    shutil.copytree(source, tmp_path / "resume-3")
    launch_scenarios(S.resume_on_three, T.OUT_ENV, tmp_path, seconds=240, num_processes=3)
    three = torch.load(tmp_path / "three.pt", weights_only=False)
    single = consolidate(source / S.RUN_ID / "train-loss.latest.ckpt", tmp_path / "one.ckpt")
    assert T.max_diff(three["loaded"], torch.load(single, weights_only=True)["model"]) == 0.0
    model = T.make_model()
    with Trainer(model, F.cross_entropy, T.make_optimizer(model), **T.trainer_kwargs()) as trainer:
        trainer.load_checkpoint(single)
        records = trainer.fit(DataLoader(T.make_data(T.TRAIN_N, 1), batch_size=3 * T.BATCH), S.val_loader())
        reference = trainer.raw_model.state_dict()
    assert len(three["records"]["train"]["loss"]) == 3
    assert T.max_diff(three["state"], reference) < EXACT
    assert three["records"]["train"]["loss"] == pytest.approx(records["train"]["loss"], abs=EXACT)


def _two_optimizer_reference(epochs: int, resume_from=None) -> tuple[dict, list]:
    """One process, the same two optimizers, the global batch; optionally loading a checkpoint first."""
    model = T.make_model()
    with Trainer(model, F.cross_entropy, S.two_optimizers(model), **T.trainer_kwargs(epochs=epochs)) as trainer:
        if resume_from is not None:
            trainer.load_checkpoint(resume_from)
        trainer.fit(DataLoader(T.make_data(T.TRAIN_N, 1), batch_size=2 * T.BATCH))
        return trainer.raw_model.state_dict(), [item.opt.state_dict() for item in trainer.opt.items]


@pytest.mark.distributed
def test_two_optimizers_under_fsdp_train_save_and_resume_like_one_process(ranks, tmp_path):
    """SGD on one layer and Adam on the other under FSDP: equal to one process with the global batch; the
    sharded checkpoint holds both optimizers' states (consolidated: SGD's momentum and Adam's moments
    equal to the one-process run's, keyed by each optimizer's own parameter index), and resuming it in
    one process for a third epoch ends as the uninterrupted 3-epoch run."""
    weights, opt_states = _two_optimizer_reference(epochs=2)
    for rank in ranks:
        assert T.max_diff(rank["two_optimizers"]["state"], weights) < EXACT
    saved = torch.load(consolidate(ranks[0]["two_optimizers"]["file"], tmp_path / "two.ckpt"), weights_only=True)
    assert len(saved["optimizers"]) == 2
    for got, want in zip(saved["optimizers"], opt_states):
        assert sorted(got["state"]) == sorted(want["state"]) == [0, 1]
        for index, state in want["state"].items():
            for name, value in state.items():
                assert float((got["state"][index][name] - value).abs().max()) < EXACT, (index, name)
    resumed, _ = _two_optimizer_reference(epochs=3, resume_from=ranks[0]["two_optimizers"]["file"])
    assert T.max_diff(resumed, _two_optimizer_reference(epochs=3)[0]) < EXACT


@pytest.mark.distributed
def test_test_under_fsdp_uses_the_best_checkpoint_then_restores_the_weights(ranks, tmp_path):
    """Under FSDP: test() evaluates the first monitor's best checkpoint (each rank reading its shards)
    and gives the model its final weights back."""
    best = torch.load(consolidate(ranks[0]["checkpoint"]["best_file"], tmp_path / "best.ckpt"), weights_only=True)
    x, y = T.make_data(T.VAL_N, 2).tensors
    expected = T.metrics_on(best["model"], x, y)
    for rank in ranks:
        run = rank["checkpoint"]
        assert run["test"] == pytest.approx(expected, abs=EXACT)
        assert T.max_diff(run["after_test"], run["saved"]) == 0.0


@pytest.mark.distributed
def test_a_mid_epoch_fsdp_snapshot_resumes_exactly_with_two_processes(ranks):
    """SnapshotCallback under FSDP: the snapshot of epoch 2 batch 3 (a sharded folder) resumes
    in a new 2-process Trainer, which finishes the run as the uninterrupted one; the epoch's records
    cover the batches before the fault too."""
    reference, _ = plain_reference(1)
    expected_val = ranks[0]["k1"]["records"]["val"]
    # 5 updates in epoch 1, then 3 in epoch 2; the newest two are kept, sharded checkpoint folders
    assert ranks[0]["snapshot"]["kept"] == ["snapshot-u000000005-epoch1.ckpt/", "snapshot-u000000008.ckpt/"]
    # the resumed run's pruning kept its newest two and removed an uncommitted folder a killed save had left
    after = ranks[0]["snapshot"]["after_resume"]
    assert len(after) == 2 and "snapshot-u000000009.ckpt" not in after and after[-1].endswith("-epoch3.ckpt")
    for rank in ranks:
        run = rank["snapshot"]
        assert run["error"] == "injected fault after a mid-epoch snapshot"
        assert T.max_diff(run["resumed"], reference) < EXACT
        assert run["records"]["train"]["sample_count"] == [float(T.TRAIN_N)] * 3  # the whole run, each epoch whole
        assert run["records"]["val"]["loss"] == pytest.approx(expected_val["loss"], abs=EXACT)


@pytest.mark.distributed
def test_a_mid_epoch_fsdp_snapshot_resumes_exactly_in_one_process(ranks, out_dir, tmp_path, monkeypatch):
    """The same 2-process snapshot resumed by one process with the whole batch (the global position carried
    over: 24 samples of epoch 2 done) ends as the uninterrupted run."""
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    ckpt_dir = tmp_path / "snapshots"
    shutil.copytree(out_dir / "snapshots-1", ckpt_dir)
    model = T.make_model()
    snap = SnapshotCallback(ckpt_dir, every_n_updates=3, on_signals=())
    # data_order='global': the order the 2 processes trained in, which one process continues exactly
    with Trainer(model, F.cross_entropy, T.make_optimizer(model), resume=S.SNAPSHOT_RUN_ID, data_order="global",
                 **T.trainer_kwargs(callbacks=[snap])) as trainer:
        # the documented resume policy for another world size (this model draws no random numbers)
        with pytest.warns(DeepEpochsWarning, match="resuming a mid-epoch snapshot of 2 process"):
            trainer.fit(DataLoader(T.make_data(T.TRAIN_N, 1), batch_size=2 * T.BATCH), S.val_loader())
        state = trainer.raw_model.state_dict()
    reference, _ = plain_reference(1)
    assert T.max_diff(state, reference) < EXACT


# ---- callbacks that read the model ------------------------------------------------------------------------
def _param_grad_scalars(folder: Path) -> dict:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
            if tag.startswith("param_grad/")}


@pytest.mark.distributed
def test_analyze_callback_under_fsdp_records_the_whole_gradients_as_one_process_does(ranks, out_dir, tmp_path,
                                                                                     monkeypatch):
    """AnalyzeCallback(mode='backward'): rank 0 writes the statistics of the whole (gathered) parameter
    gradients, equal to one process's with the whole batch; LogCallback(log_graph=True) warns on rank 0
    that an FSDP model's graph is skipped, and nothing hangs."""
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    model = T.make_model()
    with Trainer(model, F.cross_entropy, T.make_optimizer(model), running_id=S.ANALYZE_RUN_ID,
                 **T.trainer_kwargs(epochs=1, callbacks=[AnalyzeCallback(mode="backward", log_dir=tmp_path,
                                                                         histograms=False)])) as trainer:
        trainer.fit(DataLoader(T.make_data(T.TRAIN_N, 1), batch_size=2 * T.BATCH))
    expected = _param_grad_scalars(tmp_path / S.ANALYZE_RUN_ID)
    got = _param_grad_scalars(out_dir / "analyze" / S.ANALYZE_RUN_ID)
    assert sorted(got) == sorted(expected) and len(got) == 8  # mean and std of 4 parameters
    for tag, values in expected.items():
        assert got[tag] == pytest.approx(values, abs=1e-6), tag
    assert [w for w in ranks[0]["callbacks"]["warnings"] if "does not draw the graph" in w]
    assert ranks[1]["callbacks"]["warnings"] == []


# ---- mixed precision and the lr finder -----------------------------------------------------------------
@pytest.mark.distributed
def test_bf16_gathers_bf16_parameters_and_trains(ranks):
    """precision='bf16': the layers compute with bf16 parameters (MixedPrecisionPolicy), the fp32 shards
    are updated, losses are finite and both ranks end equal."""
    for rank in ranks:
        run = rank["bf16"]
        assert run["forward_dtypes"] == ["torch.bfloat16"]
        assert all(math.isfinite(v) for v in run["records"]["train"]["loss"] + run["records"]["val"]["loss"])
        assert all(v.dtype == torch.float32 for v in run["state"].values())
        assert T.max_diff(run["state"], run["before"]) > 1e-3
    assert T.max_diff(ranks[0]["bf16"]["state"], ranks[1]["bf16"]["state"]) == 0.0


@pytest.mark.distributed
def test_find_lr_under_fsdp_restores_the_sharded_weights(ranks):
    """find_lr sweeps 5 updates with the same global losses on both ranks and puts the weights back."""
    assert len(ranks[0]["find_lr"]["losses"]) == 5
    assert ranks[0]["find_lr"]["losses"] == ranks[1]["find_lr"]["losses"]
    for rank in ranks:
        assert T.max_diff(rank["find_lr"]["after"], rank["find_lr"]["before"]) == 0.0


# ---- torchrun -----------------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_example_21_trains_with_fsdp_under_torchrun_with_two_cpu_processes():
    """`torchrun --nproc-per-node=2 examples/21-distributed.py --small --strategy fsdp`: the model is sharded,
    rank 0 prints the one global test result, and the run learns (the loss is below chance, ln 2)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "torch.distributed.run", "--master-addr=127.0.0.1", f"--master-port={port}",
               "--nproc-per-node=2", "examples/21-distributed.py", "--small", "--strategy", "fsdp"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0 or teardown_abort(result.returncode, result.stderr), result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("test results")]
    assert len(lines) == 1 and lines[0].startswith("test results (world size 2): "), result.stdout
    printed = eval(lines[0].split(": ", 1)[1])  # noqa: S307 (the example's own dict of numbers)
    assert printed["sharded"] is True and printed["world_size"] == 2
    assert printed["loss"] < math.log(2)
