"""Distributed training with the Trainer: two gloo processes on the CPU.

The two-process scenarios run in one `launch` (process start-up is most of the cost); each rank saves
what it saw to a file and the tests compare those files with references computed here: a plain PyTorch
loop and a single-process Trainer with the whole batch. Every launch and subprocess has a deadline, after
which its processes are killed and the test fails instead of hanging.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

from deepepochs import Trainer
from deepepochs.data.sampling import EvalShardSampler
from deepepochs.data.sampling import shard as _shard
from deepepochs.errors import ConfigError
from deepepochs.parallel.single import SingleProcess
from deepepochs.parallel.strategy import select_policy

# Spawned children import their targets by module name; they inherit this sys.path entry.
TARGETS_DIR = Path(__file__).resolve().parent
if str(TARGETS_DIR) not in sys.path:
    sys.path.insert(0, str(TARGETS_DIR))

import ddp_targets as T  # noqa: E402  (needs the sys.path entry above)
from deadline import TORCHRUN_VARIABLES, launch_scenarios, teardown_abort  # noqa: E402  (same sys.path entry)

REPO = TARGETS_DIR.parents[1]
EXACT = 1e-5  # fp32 weights within float tolerance of the one-process run


# ---- bounded runs -------------------------------------------------------------------------------------
def _script_env() -> dict:
    """This environment without torchrun variables, on the CPU only."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _torchrun(*args) -> list:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--master-addr=127.0.0.1", f"--master-port={port}",
            "--nproc-per-node=2", *map(str, args)]


# ---- the two-process scenarios and the references -----------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory, scripts):
    """What rank 0 and rank 1 recorded in `ddp_targets.run_scenarios` (the background runs go on meanwhile)."""
    out = tmp_path_factory.mktemp("ddp")
    launch_scenarios(T.run_scenarios, T.OUT_ENV, out, seconds=240)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _windows(k: int):
    """Index ranges of the one-process run: windows of k batches of 2 * BATCH, the tail shorter."""
    size = 2 * T.BATCH * k
    return [range(start, min(start + size, T.TRAIN_N)) for start in range(0, T.TRAIN_N, size)]


def plain_reference(k: int) -> dict:
    """Plain PyTorch, one process, batch 2 * BATCH: each window's loss is the mean over its samples."""
    x, y = T.make_data(T.TRAIN_N, 1).tensors
    model = T.make_model()
    opt = T.make_optimizer(model)
    for _ in range(T.EPOCHS):
        for window in _windows(k):
            F.cross_entropy(model(x[window]), y[window]).backward()
            opt.step()
            opt.zero_grad()
    return model.state_dict()


@pytest.fixture(scope="module")
def single_process():
    """The Trainer in this process with batch 2 * BATCH (k = 1 and 2): state, records and test metrics."""
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        for name in TORCHRUN_VARIABLES:
            patch.delenv(name, raising=False)
        for k in (1, 2):
            model = T.make_model()
            with Trainer(model, F.cross_entropy, T.make_optimizer(model),
                         **T.trainer_kwargs(gradient_accumulation_steps=k)) as trainer:
                records = trainer.fit(DataLoader(T.make_data(T.TRAIN_N, 1), batch_size=2 * T.BATCH),
                                      DataLoader(T.make_data(T.VAL_N, 2), batch_size=6))
                out[k] = {"state": trainer.raw_model.state_dict(), "records": records}
    return out


# ---- the same weights as one process with the whole batch --------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize(("scenario", "k"), [("equivalence", 1), ("accumulation", 2), ("split_batches", 1)])
def test_ddp_weights_equal_one_process_with_the_whole_batch(ranks, single_process, scenario, k):
    """World size 2 x batch b (also k=2 with a tail window, and split_batches) = one process, batch 2b."""
    reference = plain_reference(k)
    for rank in ranks:
        state = rank[scenario]["state"]
        assert T.max_diff(state, reference) < EXACT
        assert T.max_diff(state, single_process[k]["state"]) < EXACT
    assert T.max_diff(ranks[0][scenario]["state"], ranks[1][scenario]["state"]) == 0.0


@pytest.mark.distributed
@pytest.mark.parametrize(("scenario", "syncs"), [("equivalence", 5 * T.EPOCHS), ("accumulation", 3 * T.EPOCHS)])
def test_gradients_are_all_reduced_only_on_the_updating_micro_batch(ranks, scenario, syncs):
    """5 batches per epoch; with k=2 the windows are 2+2+1, so 3 all-reduces per epoch, not 5."""
    assert [rank[scenario]["syncs"] for rank in ranks] == [syncs, syncs]


# ---- global metrics, exactly-once evaluation shards --------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize(("scenario", "k"), [("equivalence", 1), ("accumulation", 2)])
def test_validation_metrics_under_ddp_equal_the_single_process_metrics(ranks, single_process, scenario, k):
    """37 validation samples over 2 ranks: each counted once, every epoch's metrics as in one process."""
    T.check_val_records(ranks, scenario, single_process[k]["records"]["val"], EXACT)


@pytest.mark.distributed
def test_ddp_kwargs_reach_ddp_and_a_model_with_unused_parameters_trains(ranks, single_process):
    """ddp_kwargs={'find_unused_parameters': True}: a model with a head its forward never uses trains
    under DDP (without it DDP raises at the second step); the used part ends as one process with the
    whole batch does, the unused head is untouched."""
    for rank in ranks:
        run = rank["unused_parameters"]
        assert run["find_unused_parameters"] is True
        assert T.max_diff(run["used"], single_process[1]["state"]) < EXACT
        assert T.max_diff(run["unused"], run["unused_before"]) == 0


@pytest.mark.distributed
def test_interprete_callback_keeps_the_global_best_samples_on_every_rank(ranks):
    """InterpreteCallback under DDP: each rank ends with the best k of the whole test set, exactly the
    samples one process keeps (stable order: among equal values the sample first in the dataset), both
    for a continuous metric and for one with many ties."""
    x, y = T.make_data(T.VAL_N, 2, index_feature=True).tensors
    with torch.no_grad():
        logits = T.make_model()(x)
    classes = logits.shape[1]
    counts = torch.zeros(classes, classes, dtype=torch.int64)
    counts.index_put_((y, logits.argmax(1)), torch.tensor(1), accumulate=True)
    for rank in ranks:  # confusion=True: every rank holds the whole test set's matrix (ranks' counts summed)
        assert rank["interprete"]["confusion"] == counts.tolist()
    for name, metric in T.interprete_metrics().items():
        scores = metric(logits, y).double()
        order = torch.sort(scores, descending=True, stable=True).indices[:5]
        want = [(float(scores[i]), int(x[i, 0].round())) for i in order]
        for rank in ranks:
            got = rank["interprete"][name]
            assert [index for _, index in got] == [index for _, index in want], name
            assert [value for value, _ in got] == pytest.approx([value for value, _ in want], rel=1e-6)


@pytest.mark.distributed
def test_test_metrics_equal_a_recomputation_on_the_whole_dataset(ranks):
    """trainer.test under DDP = loss/accuracy of the final weights over all 37 samples at once."""
    for rank in ranks:
        expected = T.metrics_on(rank["equivalence"]["state"], *T.make_data(T.VAL_N, 2).tensors)
        assert rank["equivalence"]["test"] == pytest.approx(expected, abs=EXACT)


@pytest.mark.distributed
def test_every_rank_reports_the_same_global_metrics(ranks):
    """Training and validation records and test results are identical on both ranks."""
    for scenario in ("equivalence", "accumulation", "split_batches"):
        assert ranks[0][scenario]["records"] == ranks[1][scenario]["records"]
        assert ranks[0][scenario]["test"] == ranks[1][scenario]["test"]


@pytest.mark.distributed
def test_an_empty_evaluation_shard_still_gives_global_metrics(ranks):
    """A one-sample test set leaves rank 1 without any batch; both ranks report that sample's metrics."""
    expected = T.metrics_on(T.make_model().state_dict(), *T.make_data(T.VAL_N, 2)[:1])
    for rank in ranks:
        assert rank["tiny_test_set"] == pytest.approx(expected, abs=EXACT)


# ---- predict under DDP -------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_predict_under_ddp_returns_each_sample_once_in_dataset_order_on_rank_0(ranks):
    """Two ranks predict 37 samples (shards of 19 and 18): rank 0 returns the plain model's outputs for all
    of them in dataset order (nested dict kept, on the CPU), rank 1 returns None; one sample works too."""
    x, _ = T.make_data(T.VAL_N, 2, index_feature=True).tensors
    with torch.no_grad():
        reference = T.make_model()(x)
    full = ranks[0]["predict"]["full"]
    assert set(full) == {"logits", "index"}
    assert full["index"].tolist() == list(range(T.VAL_N))
    assert full["logits"].device.type == "cpu"
    torch.testing.assert_close(full["logits"], reference)
    one = ranks[0]["predict"]["one"]
    torch.testing.assert_close(one["logits"], reference[:1])
    assert ranks[1]["predict"]["full"] is None and ranks[1]["predict"]["one"] is None
    assert ranks[0]["predict"]["fit_epochs"] == ranks[1]["predict"]["fit_epochs"] == 1


@pytest.mark.distributed
def test_find_lr_under_ddp_agrees_across_ranks_and_restores_the_weights(ranks):
    """Both ranks sweep the same rates with the same (global) losses, stop at the same update, get their
    weights back, and can fit afterwards (no rank left waiting in a collective)."""
    a, b = ranks[0]["find_lr"], ranks[1]["find_lr"]
    assert a["lrs"] == b["lrs"] and len(a["lrs"]) >= 3
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
    assert a["restored"] and b["restored"] and a["fit_epochs"] == b["fit_epochs"] == 1


@pytest.mark.distributed
def test_a_refit_after_a_fault_under_ddp_ends_with_the_uninterrupted_runs_batchnorm_statistics(ranks):
    """The rollback puts every rank's buffers back in place (the tensors DDP broadcasts), so the refit's
    running statistics and counts equal those of the run never interrupted, on both ranks."""
    for rank in ranks:
        refit, whole = rank["batchnorm_refit"]["refit"], rank["batchnorm_refit"]["whole"]
        assert refit.keys() == whole.keys() and "1.num_batches_tracked" in refit
        for name, value in whole.items():
            assert torch.equal(refit[name], value), name


# ---- sharding and sampler epochs ---------------------------------------------------------------------------
@pytest.mark.distributed
def test_shuffled_training_shards_are_disjoint_complete_and_reshuffled_each_epoch(ranks):
    """shuffle=True: per epoch the two shards partition the 16 samples, in a new order each epoch."""
    seen = [rank["shuffled_indices"] for rank in ranks]
    for epoch in (1, 2):
        assert sorted(seen[0][epoch] + seen[1][epoch]) == list(range(16))
    assert seen[0][1] != seen[0][2]


# ---- rank 0's weights everywhere, main_process_first, the process group ----
@pytest.mark.distributed
def test_parameters_are_broadcast_from_rank_0_after_init_callbacks(ranks):
    """on_before_fit sets rank r's weights to r + 1; after the broadcast both ranks hold rank 0's 1.0."""
    assert [rank["broadcast_values"] for rank in ranks] == [[1.0], [1.0]]


@pytest.mark.distributed
def test_main_process_first_lets_rank_0_finish_before_the_others_start(ranks):
    """Rank 1 enters the block only after rank 0 wrote its file."""
    assert [rank["main_process_first"]["found"] for rank in ranks] == [True, True]


@pytest.mark.distributed
def test_trainer_destroys_only_the_process_group_it_created(ranks):
    """A group the Trainer initialised is gone after close(); a group the caller initialised survives."""
    for rank in ranks:
        assert rank["equivalence"]["group_during_fit"] and rank["equivalence"]["world_size"] == 2
        assert rank["group_destroyed_after_close"]
        assert rank["user_group"] == {"world_size": 2, "alive_after_close": True}
    assert [rank["equivalence"]["is_main"] for rank in ranks] == [True, False]


# ---- configuration errors ----------------------------------------------------------------------------------
@pytest.mark.distributed
def test_different_training_batch_counts_raise_instead_of_hanging(ranks):
    """A user sampler giving rank 0 two batches and rank 1 one: DistributedError on both ranks at fit()."""
    for rank in ranks:
        error = rank["uneven_training_error"]
        assert error["type"] == "DistributedError"
        assert "different number of batches on each rank (rank 0: 2, rank 1: 1)" in error["message"]


@pytest.mark.distributed
def test_split_batches_needs_a_batch_size_the_world_size_divides(ranks):
    """split_batches with batch_size=5 and 2 processes: a ConfigError that names both numbers."""
    for rank in ranks:
        assert rank["split_batches_error"]["type"] == "ConfigError"
        assert "must be a multiple of it (got batch_size=5)" in rank["split_batches_error"]["message"]


@pytest.mark.distributed
def test_a_checkpoint_rank_0_cannot_write_stops_every_rank_at_that_save(ranks):
    """Rank 0's save fails (a user's folder stands where the file goes): rank 0 raises its CheckpointError
    and rank 1 one saying rank 0 could not save, at the same epoch's end (no rank waits in a collective the
    other never joins); the same trainers then fit on to a writable folder together."""
    errors = [rank["save_failure"]["error"] for rank in ranks]
    assert errors[0] is not None and "cannot save checkpoint" in errors[0] and "blocked" in errors[0]
    assert errors[1] is not None and "rank 0 could not save checkpoint" in errors[1]
    for rank in ranks:  # the refit finished epoch 1 (its end had failed) and trained epoch 2
        assert rank["save_failure"]["completed"] == 2 and len(rank["save_failure"]["records"]["train"]["loss"]) == 2
    assert ranks[0]["save_failure"]["records"] == ranks[1]["save_failure"]["records"]
    assert ranks[0]["save_failure"]["written"]


@pytest.mark.distributed
def test_only_rank_0_locks_the_run_and_a_refusal_stops_every_rank(ranks):
    """A run another process trains: both ranks' fit raise RunLockedError with rank 0's message (none waits
    in a collective); once free, both train, and the lock file names rank 0 throughout; rank 0 removes it."""
    errors = [rank["run_lock"]["error"] for rank in ranks]
    pid = ranks[0]["run_lock"]["pid"]
    assert errors[0] == errors[1] and f"is being trained by another process: pid {pid} on host" in errors[0]
    for rank in ranks:
        assert rank["run_lock"]["seen"] == [pid, pid] and rank["run_lock"]["completed"] == 2
    assert not ranks[0]["run_lock"]["left"]


@pytest.mark.distributed
def test_training_data_deepepochs_cannot_split_is_named_once_on_rank_0(ranks):
    """A list of batches is trained whole on every rank: rank 0 warns once over two fits, saying to pass a
    DataLoader or shard it yourself; rank 1 says nothing; a plain DataLoader or the caller's
    DistributedSampler draws no warning."""
    said = ranks[0]["unsplit_warnings"]
    assert len(said["list of batches"]) == 1
    message = said["list of batches"][0]
    assert message.startswith("training data is not split: the list given to fit() is not a DataLoader deepepochs"
                              " can shard, so each of the 2 processes trains on all of it as given")
    assert "Pass a DataLoader built with batch_size= and shuffle=" in message and "shard it yourself" in message
    assert said["plain DataLoader"] == said["DistributedSampler"] == []
    assert ranks[1]["unsplit_warnings"] == {kind: [] for kind in said}


# ---- a failing rank ends every rank ------------------------------------------------------------------------
@pytest.mark.distributed
def test_a_rank_raising_during_training_makes_launch_raise_within_seconds(scripts):
    """Rank 1 raises mid-epoch while rank 0 waits in the gradient all-reduce: the caller gets the error."""
    outcome = json.loads(_succeeded(scripts["rank_failure"]).stdout.strip().splitlines()[-1])
    assert outcome["error_type"] == "DistributedError", outcome
    assert "rank 1 failed during training on purpose" in outcome["message"]
    # launch's grace period is 2 s; the margin is for a loaded machine.
    assert outcome["seconds_after_the_failure"] < 20 and outcome["children_left"] == 0


# ---- sharding rules, without processes ------------------------------------------------------------------
def _dataset(n=37):
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.zeros(n))


class _Subclass(DataLoader):
    pass


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize(
    ("make", "plain"),
    [
        (lambda ds: DataLoader(ds, batch_size=4), True),
        (lambda ds: DataLoader(ds, batch_size=4, shuffle=True, drop_last=True), True),
        (lambda ds: DataLoader(ds, batch_size=None), True),
        (lambda ds: DataLoader(ds, batch_size=4, sampler=list(range(10))), False),
        (lambda ds: DataLoader(ds, batch_size=4, sampler=RandomSampler(ds, replacement=True)), False),
        (lambda ds: DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 4, False)), False),
        (lambda ds: DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 2, 0)), False),
        (lambda ds: _Subclass(ds, batch_size=4), False),
        (lambda ds: DataLoader(_Stream(), batch_size=2), False),
    ],
    ids=["sequential", "shuffled", "unbatched", "index-list", "with-replacement", "batch-sampler",
         "user-distributed-sampler", "subclass", "iterable-dataset"],
)
def test_only_plain_dataloaders_are_resharded(make, plain):
    """The trainer rebuilds DataLoaders that use DataLoader's own sampling; others are kept."""
    assert (_shard(make(_dataset()), "train", 0, 2, False) is not None) == plain


def test_training_shards_are_padded_to_equal_length_and_keep_the_loader_settings():
    """37 samples, 2 ranks: 19 indices each (one repeated), shuffling and drop_last kept."""
    original = DataLoader(_dataset(), batch_size=4, shuffle=True, drop_last=True)
    shards = [_shard(original, "train", rank, 2, False) for rank in (0, 1)]
    for shard in shards:
        assert isinstance(shard.sampler, DistributedSampler) and shard.sampler.shuffle
        assert len(shard.sampler) == 19 and shard.drop_last and shard.batch_size == 4
    indices = list(shards[0].sampler) + list(shards[1].sampler)
    assert set(indices) == set(range(37)) and len(indices) == 38


def test_evaluation_shards_hold_every_sample_exactly_once():
    """37 samples over 3 ranks: 13 + 12 + 12 indices, no padding, drop_last not applied."""
    original = DataLoader(_dataset(), batch_size=5, drop_last=True)
    shards = [_shard(original, "val", rank, 3, False) for rank in range(3)]
    assert all(isinstance(s.sampler, EvalShardSampler) and not s.drop_last for s in shards)
    assert [len(s.sampler) for s in shards] == [13, 12, 12]
    assert sorted(i for s in shards for i in s.sampler) == list(range(37))
    seen = sorted(int(v) for s in shards for x, _ in s for v in x.flatten())
    assert seen == list(range(37))


def test_split_batches_divides_the_batch_size_by_the_world_size():
    """split_batches: 8 per batch over 4 ranks gives 2 per rank; 6 over 4 is a ConfigError."""
    assert _shard(DataLoader(_dataset(), batch_size=8), "train", 0, 4, True).batch_size == 2
    with pytest.raises(ConfigError, match=r"batch_size must be a multiple of it \(got batch_size=6\)"):
        _shard(DataLoader(_dataset(), batch_size=6), "train", 0, 4, True)


@pytest.mark.parametrize("env", [{}, {"RANK": "0", "WORLD_SIZE": "1"}])
def test_without_several_processes_the_policy_is_single_process(monkeypatch, env):
    """No torchrun variables, or a world size of 1: the no-op policy, no process group."""
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    policy = select_policy(torch.device("cpu"))
    assert isinstance(policy, SingleProcess) and policy.world_size == 1
    assert policy.sync_patches({"a": 1}) == {"a": 1}


# ---- scripts: smoke checks, multi-GPU checks, example 21 ----------------------------------------------
# Runs several scripts in one interpreter (each as __main__ with its own argv), to pay torch's import
# once: the one-process smoke run, the plain one-process example, and the CUDA command lines, which must
# skip without CUDA.
_DRIVER = textwrap.dedent(
    """
    import contextlib, io, json, runpy, sys
    sys.path.insert(0, "tests")
    outcomes = []
    for argv in json.loads(sys.argv[1]):
        sys.argv = argv
        out = io.StringIO()
        code = 0
        with contextlib.redirect_stdout(out):
            try:
                runpy.run_path(argv[0], run_name="__main__")
            except SystemExit as exc:
                code = exc.code or 0
        outcomes.append({"argv": argv, "code": code, "stdout": out.getvalue()})
    print(json.dumps(outcomes))
    """
)


# Calls launch on a training run in which rank 1 fails; prints the outcome as JSON.
_FAILING_LAUNCH = textwrap.dedent(
    """
    import json, multiprocessing, os, pathlib, sys, time
    sys.path.insert(0, "tests/distributed")
    import ddp_targets
    from deepepochs.launch import launch
    os.environ[ddp_targets.OUT_ENV] = sys.argv[1]
    try:
        launch(ddp_targets.raise_on_rank_1_during_training, num_processes=2)
        outcome = {"error_type": None, "message": "launch returned"}
    except Exception as exc:
        outcome = {"error_type": type(exc).__name__, "message": str(exc)}
    failed_at = float((pathlib.Path(sys.argv[1]) / "failed_at").read_text())
    outcome["seconds_after_the_failure"] = time.time() - failed_at
    outcome["children_left"] = len(multiprocessing.active_children())
    print(json.dumps(outcome))
    """
)


class _Background:
    """A command running in its own session, output to files (a full pipe would block it)."""

    def __init__(self, command: list, seconds: float, folder: Path):
        self.command, self.deadline = command, time.monotonic() + seconds
        self.stdout, self.stderr = open(folder / "stdout", "w+"), open(folder / "stderr", "w+")
        self.process = subprocess.Popen(command, cwd=REPO, env=_script_env(), stdout=self.stdout,
                                        stderr=self.stderr, text=True, start_new_session=True)

    def result(self) -> subprocess.CompletedProcess:
        """Wait for the command (up to its deadline; then kill its session and fail)."""
        try:
            self.process.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{' '.join(map(str, self.command))} did not finish in time\n{self._read()[1]}")
        stdout, stderr = self._read()
        return subprocess.CompletedProcess(self.command, self.process.returncode, stdout, stderr)

    def _read(self):
        for f in (self.stdout, self.stderr):
            f.flush()
            f.seek(0)
        return self.stdout.read(), self.stderr.read()

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # torchrun's or launch's workers too
            self.process.wait()

    def close(self) -> None:
        self.kill()
        self.stdout.close()
        self.stderr.close()


def _skip_forms(tmp: Path) -> list:
    return [
        ["tests/smoke_training.py", "--device", "cuda", "--precision", "fp16", "--output", str(tmp / "a")],
        ["tests/smoke_launch.py", "--expected-world-size=4", "--device=cuda", "--precision=fp16",
         "--output", str(tmp / "b")],
        ["tests/multigpu_training.py", "--expected-world-size", "4", "--precision", "fp16",
         "--output", str(tmp / "c.json")],
        ["tests/multigpu_evaluation.py", "--expected-world-size", "4", "--precision", "fp16",
         "--output", str(tmp / "d")],
        ["tests/single_gpu_checkpoint.py", "--checkpoint", str(tmp / "missing.ckpt"), "--source-world-size",
         "4", "--precision", "fp16", "--device", "cuda:0", "--output", str(tmp / "e")],
    ]


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """All script runs, started together in the background (they overlap with the in-process launches)."""
    folders = {name: tmp_path_factory.mktemp(name) for name in
               ("in_one_process", "smoke_torchrun", "smoke_launch", "example_launch", "example_torchrun",
                "rank_failure")}
    one = folders["in_one_process"]
    in_one_process = [["tests/smoke_training.py", "--output", str(one / "smoke")],
                      ["examples/21-distributed.py", "--small"]]
    if not torch.cuda.is_available():
        in_one_process += _skip_forms(one)
    commands = {
        "in_one_process": [sys.executable, "-c", _DRIVER, json.dumps(in_one_process)],
        "smoke_torchrun": _torchrun("tests/smoke_training.py", "--output", folders["smoke_torchrun"] / "out"),
        "smoke_launch": [sys.executable, "tests/smoke_launch.py", "--num-processes=2", "--expected-world-size=2",
                         "--device=cpu", "--output", folders["smoke_launch"] / "out"],
        "example_launch": [sys.executable, "examples/21-distributed.py", "--small", "--num-processes", "2"],
        "example_torchrun": _torchrun("examples/21-distributed.py", "--small"),
        "rank_failure": [sys.executable, "-c", _FAILING_LAUNCH, folders["rank_failure"]],
    }
    runs = {name: _Background(list(map(str, command)), 240, folders[name]) for name, command in commands.items()}
    runs["folders"] = folders
    yield runs
    for name in commands:
        runs[name].close()


def _result(folder: Path) -> dict:
    return json.loads((folder / "result.json").read_text())


def _succeeded(run: _Background) -> subprocess.CompletedProcess:
    """The finished run; it exited 0, or (torchrun) ended only by torch's abort at exit: the callers check
    what it produced either way."""
    done = run.result()
    assert done.returncode == 0 or teardown_abort(done.returncode, done.stderr), done.stdout + done.stderr
    return done


@pytest.mark.distributed
def test_smoke_training_passes_in_one_process_and_the_cuda_command_lines_skip_cleanly(scripts):
    """`python tests/smoke_training.py --output DIR` passes; without CUDA the seed's CUDA lines exit 0."""
    smoke, example, *skipped = json.loads(_succeeded(scripts["in_one_process"]).stdout.strip().splitlines()[-1])
    folder = scripts["folders"]["in_one_process"]
    assert smoke["code"] == 0, smoke["stdout"]
    assert _result(folder / "smoke")["status"] == "passed" and _result(folder / "smoke")["world_size"] == 1
    for outcome in skipped:
        assert outcome["code"] == 0, outcome
        assert "skipped: CUDA not available" in outcome["stdout"], outcome
    if skipped:
        assert json.loads((folder / "c.json").read_text())["status"] == "skipped"
        assert _result(folder / "d")["status"] == "skipped"


@pytest.mark.distributed
def test_smoke_training_passes_under_torchrun_with_two_cpu_processes(scripts):
    """`torchrun --nproc-per-node=2 tests/smoke_training.py --output DIR`: world size 2, all checks pass."""
    _succeeded(scripts["smoke_torchrun"])
    result = _result(scripts["folders"]["smoke_torchrun"] / "out")
    assert result["status"] == "passed" and result["world_size"] == 2, result["checks"]


@pytest.mark.distributed
def test_smoke_launch_passes_with_two_cpu_processes(scripts):
    """`python tests/smoke_launch.py --num-processes=2 --expected-world-size=2 --device=cpu`."""
    _succeeded(scripts["smoke_launch"])
    result = _result(scripts["folders"]["smoke_launch"] / "out")
    assert result["status"] == "passed" and result["world_size"] == 2, result["checks"]


@pytest.mark.distributed
def test_example_21_runs_in_one_cpu_process_by_default(scripts):
    """`python examples/21-distributed.py` without GPUs trains in the calling process (world size 1)."""
    outcomes = json.loads(_succeeded(scripts["in_one_process"]).stdout.strip().splitlines()[-1])
    example = outcomes[1]
    assert example["code"] == 0 and "test results (world size 1)" in example["stdout"], example


@pytest.mark.distributed
def test_example_21_trains_with_two_processes_through_launch(scripts):
    """`python examples/21-distributed.py --small --num-processes 2` prints rank 0's global test result."""
    assert "test results (world size 2)" in _succeeded(scripts["example_launch"]).stdout


@pytest.mark.distributed
def test_example_21_trains_under_torchrun_with_two_cpu_processes(scripts):
    """`torchrun --nproc-per-node=2 examples/21-distributed.py --small`: one result line, from rank 0."""
    assert _succeeded(scripts["example_torchrun"]).stdout.count("test results (world size 2)") == 1
