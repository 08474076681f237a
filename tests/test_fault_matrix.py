"""A fault matrix generated from the spec: every state a stage enters (recorded from a clean run of that
stage, so a new state of the spec is covered as soon as a stage reaches it), in every stage (fit: training
and validation, by epochs and by updates; a fit with SWA over a BatchNorm model, whose BatchNorm pass is the
`fit_statistics` stage; test; predict; the LR sweep), gets each fault kind on entering it: an exception in
user code, SIGINT, and the listed signals SIGTERM and SIGUSR1 to the process. Each cell must end in a
documented outcome, and where the run continues it ends bit-identical to the uninterrupted run:

- exception / SIGINT: rolled back and ready (the machine idle), the exception re-raised; running the
  stage again gives the uninterrupted result (fit: weights, optimizer, scheduler, scaler and history);
- SIGTERM / SIGUSR1 during fit (a `SnapshotCallback` listens): `Preempted` with 128 + the signal's number
  and a snapshot; a new trainer resumed from it ends as the uninterrupted fit;
- every fit cell also runs with each other kind of data and step (`fault_matrix_setup.DATA`, each kind's states
  recorded from its own clean run): training and validation DataLoaders whose workers persist from epoch to
  epoch, a length-less stream drawing from its own generator, a custom step returning the loss it gave
  `self.backward(loss)`, and one running its own `loss.backward()`; each ends bit-identical all the same;
- SIGTERM / SIGUSR1 where nothing listens (test, predict, the LR sweep, or after the fit disarmed): the
  handler in place gets it (the default one would end the process; here a recorder stands in for it) and
  the stage is unaffected.

Three more kinds of cell run in processes of their own (tests/fault_matrix_target.py):

- the job's whole process group signalled (SIGTERM, SIGUSR1, SIGINT), as a scheduler does, on entering every
  state a stage enters while its DataLoader workers (fork and spawn) are alive: the outcomes above, never
  torch's worker error; where nothing listens the process ends killed by the signal;
- SIGKILL on entering every state of a fit (a snapshot after every update): a new process resumed from the
  last file ends bit-identical to the uninterrupted fit (test, predict and the LR sweep write no file);
- a seeded subset under 2 gloo processes (`launch`), the fault on one rank: a listened signal in a fit stops
  both with `Preempted` and the resume ends as the uninterrupted 2-rank run; any other fault ends the group
  with `DistributedError` naming the faulted rank.

`make test` runs a fixed seeded sample of each kind (of the in-process cells: 24 on plain data, 2 of each
other data and step kind, and each fault in `fit_statistics`); `DEEPEPOCHS_FAULT_MATRIX=full` (`make fault-matrix`)
runs every cell (and 12 DDP cells). DEEPEPOCHS_FAULT_MATRIX_REPORT names a file each cell appends its outcome to.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from fault_matrix_setup import DATA, FITS, STAGES, entered_states, make_trainer, stage_data, stage_result  # tests/
from fault_matrix_target import DDP_VARIABLES, ddp_cell  # tests/
from state_compare import states_equal  # tests/, on sys.path under pytest

from deepepochs import Preempted
from deepepochs.errors import DeepEpochsWarning, DistributedError
from deepepochs.fsm.machine import load_spec

sys.path.insert(0, str(Path(__file__).with_name("distributed")))
from deadline import TORCHRUN_VARIABLES, launch_with_deadline  # noqa: E402  (tests/distributed)

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs POSIX signals")

SPEC = load_spec()
FAULTS = ("exception", "SIGINT", "SIGTERM", "SIGUSR1")
FULL = os.environ.get("DEEPEPOCHS_FAULT_MATRIX", "") == "full"
SAMPLE_SIZE, SAMPLE_SEED = 24, 20261204
#: the default sample's cells of each data kind but the plain one
OTHER_DATA_SAMPLE = 2


class Injected(Exception):
    pass


def _trainer(folder, stage, resume=False, snapshot_signal=None, data="plain"):
    return make_trainer(folder, stage, resume=resume, snapshot_signal=snapshot_signal, data=data)


def _run(trainer, stage, data="plain", given=None):
    return stage_result(trainer, stage, data=data, given=given)


_REFERENCE: dict = {}


def _reference(stage, tmp_path_factory, data="plain"):
    """(the uninterrupted result, how often each state was entered) of `stage` on `data`, recorded once."""
    if (stage, data) not in _REFERENCE:
        trainer = _trainer(tmp_path_factory.mktemp("reference"), stage, data=data)
        entered = collections.Counter()
        trainer.machine.probe = lambda dest: entered.update([dest])
        result = _run(trainer, stage, data)
        trainer.machine.probe = None
        _REFERENCE[stage, data] = (result, entered)
    return _REFERENCE[stage, data]


#: Worker processes for the collection run: fork where there is one (the states entered while a stage's
#: DataLoader workers are alive are the process-group cells).
_COLLECT = (2, "fork") if "fork" in multiprocessing.get_all_start_methods() else (0, None)
ENTERED, WITH_WORKERS = {}, {}
for _stage in STAGES:
    ENTERED[_stage], WITH_WORKERS[_stage], _ = entered_states(_stage, *_COLLECT)
#: the data kinds the matrix runs (in the fits): the persistent workers need fork
_DATA = tuple(data for data in DATA if data != "persistent" or "fork" in multiprocessing.get_all_start_methods())
#: the states each other kind of data or step enters in each fit (an fp32 step skips no update), from a clean
#: run without collection workers: its result is the uninterrupted run the kind's cells compare with
ENTERED_ON = {}
for _stage in FITS:
    for _data in _DATA[1:]:
        ENTERED_ON[_stage, _data], _, _result = entered_states(_stage, data=_data)
        _REFERENCE[_stage, _data] = (_result, ENTERED_ON[_stage, _data])
_PLAIN = [(stage, state, fault, "plain") for stage in STAGES for state in sorted(ENTERED[stage]) for fault in FAULTS]


def _kind_cells(data) -> list:
    """Every (state, fault) the fits enter on `data`, each in one fit: the fits that enter the state take turns
    (so each kind runs in every fit, and a state only one fit enters, `fit_statistics`, in that one)."""
    pairs = sorted({(state, fault) for stage in FITS for state in ENTERED_ON[stage, data] for fault in FAULTS})
    cells = []
    for turn, (state, fault) in enumerate(pairs):
        stages = [stage for stage in FITS if state in ENTERED_ON[stage, data]]
        cells.append((stages[turn % len(stages)], state, fault, data))
    return cells


CELLS = _PLAIN + [cell for data in _DATA[1:] for cell in _kind_cells(data)]
#: the default sample: SAMPLE_SIZE plain cells, OTHER_DATA_SAMPLE of each other kind, each fault in the pass
SELECTED = CELLS if FULL else sorted(set(
    random.Random(SAMPLE_SEED).sample(_PLAIN, min(SAMPLE_SIZE, len(_PLAIN)))
    + [cell for turn, data in enumerate(_DATA[1:]) for cell in random.Random(SAMPLE_SEED + turn).sample(
        [cell for cell in CELLS if cell[3] == data], OTHER_DATA_SAMPLE)]
    + [cell for cell in _PLAIN if cell[1] == "fit_statistics"]))


def test_every_state_of_the_spec_is_in_the_matrix_or_entered_only_by_a_fault():
    """The matrix follows the spec: a state no clean stage enters must be one only a fault leads to (the
    destination of an `interrupt` or `snapshot` edge), else the matrix would miss it."""
    covered = set().union(*ENTERED.values())
    fault_only = {t.dest for t in SPEC.transitions if t.trigger in ("interrupt", "snapshot") and t.dest}
    assert {s.name for s in SPEC.states} - covered <= fault_only - covered
    assert {s.name for s in SPEC.states} - covered - fault_only == set()


#: The rollback's warning that a step running its own loss.backward() never gave the trainer the loss of the
#: batch whose update it kept: the trainer sees that loss only once the step returns it.
LEFT_OUT = "the training step of epoch .* applied its update and then raised before returning its loss"


def _records_leave_out(result, reference, epoch) -> bool:
    """`result` is `reference` bit for bit (weights, optimizer, scheduler, averages and every record) except
    the training loss of `epoch`, whose mean leaves out the batch the warning named."""
    train, expected = result["history"]["train"]["loss"], reference["history"]["train"]["loss"]

    def without_the_epoch(state, losses):
        history = state["history"]
        return {**state, "history": {**history, "train": {**history["train"],
                                                          "loss": losses[:epoch - 1] + losses[epoch:]}}}

    return (len(train) == len(expected) and train[epoch - 1] != expected[epoch - 1]
            and states_equal(without_the_epoch(result, train), without_the_epoch(reference, expected)))


def _report(stage, state, fault, outcome, data="plain") -> None:
    """Append the cell's outcome to the file DEEPEPOCHS_FAULT_MATRIX_REPORT names (the full run's counts)."""
    path = os.environ.get("DEEPEPOCHS_FAULT_MATRIX_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(f"{stage} {state} {fault} {outcome}{'' if data == 'plain' else ' ' + data}\n")


class _Recorder:
    """A stand-in for a signal's default handler: records the signals that reach it."""

    def __init__(self):
        self.got = []

    def __call__(self, signum, frame):
        self.got.append(signal.Signals(signum).name)


@pytest.mark.parametrize(("stage", "state", "fault", "data"), SELECTED)
def test_a_fault_in_any_state_of_any_stage_ends_in_a_documented_outcome(stage, state, fault, data, tmp_path,
                                                                      tmp_path_factory):
    """Inject `fault` on entering `state` during `stage` on `data`; the outcome is a documented one, and where
    the run continues it ends as the uninterrupted run."""
    with warnings.catch_warnings():  # persistent workers made anew: the documented warning about their draws
        warnings.filterwarnings("ignore", "continuing the fit after an interrupt", DeepEpochsWarning)
        if data == "stream":  # streamed past its trained batches: the documented warning that its order is its own
            warnings.filterwarnings("ignore", "resuming inside an epoch", DeepEpochsWarning)
        _fault_cell(stage, state, fault, data, tmp_path, tmp_path_factory)


def _fault_cell(stage, state, fault, data, tmp_path, tmp_path_factory):
    reference, entered = _reference(stage, tmp_path_factory, data)
    occurrence = 2 if entered[state] >= 2 else 1
    listened = fault in ("SIGTERM", "SIGUSR1") and stage in FITS
    trainer = _trainer(tmp_path / "snap", stage, snapshot_signal=fault if listened else None, data=data)
    # The refit of a stream runs on the stream it was given, as `fit()` called again does. (Made anew, a stream
    # or DataLoader with its own generator restarts from its seed after a fault past an epoch's training:
    # known, not yet fixed; the other kinds' refits run on data made anew.)
    given = stage_data(data) if data == "stream" else None
    seen = collections.Counter()

    def probe(dest):
        if dest != state:
            return
        seen[dest] += 1
        if seen[dest] != occurrence:
            return
        if fault == "exception":
            raise Injected(f"injected on entering {state}")
        signal.raise_signal(getattr(signal, fault))

    recorder = _Recorder()
    previous = {sig: signal.signal(sig, recorder) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        trainer.machine.probe = probe
        outcome = None
        try:
            with warnings.catch_warnings(record=True) as left_out:
                warnings.filterwarnings("always", LEFT_OUT, DeepEpochsWarning)
                result = _run(trainer, stage, data, given)
        except (Injected, KeyboardInterrupt) as exc:
            outcome = "rolled back"
            assert fault in ("exception", "SIGINT") and (fault == "exception") == isinstance(exc, Injected)
        except Preempted as stop:
            outcome = "preempted"
            assert listened and stop.code == 128 + getattr(signal, fault) and stop.path.exists()
        trainer.machine.probe = None
        if outcome is None:  # nothing stopped it: the handler in place got the signal
            assert seen[state] >= occurrence, "the fault was never injected"
            assert fault in ("SIGTERM", "SIGUSR1") and recorder.got == [fault]
            assert states_equal(result, reference)
            _report(stage, state, fault, "handler in place, unaffected", data)
            return
        assert trainer.machine.state == "idle"
        if outcome == "rolled back" and left_out:
            # own loss.backward(), the fault after the update and before the step returned: the documented limit
            assert data == "own_backward" and len(left_out) == 1, [str(w.message) for w in left_out]
            epoch = int(re.search(r"epoch (\d+), batch", str(left_out[0].message))[1])
            assert _records_leave_out(_run(trainer, stage, data, given), reference, epoch)
            outcome = "rolled back, the batch left out of the records (warned)"
        elif outcome == "rolled back":
            assert states_equal(_run(trainer, stage, data, given), reference)
        else:
            resumed = _trainer(tmp_path / "snap", stage, resume=True, snapshot_signal=fault, data=data)
            assert states_equal(_run(resumed, stage, data), reference)
        _report(stage, state, fault, outcome, data)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---- cells in a process of their own: the job's process group signalled, SIGKILL and resume -------------------
TARGET = Path(__file__).with_name("fault_matrix_target.py")
CONTEXTS = tuple(c for c in ("fork", "spawn") if c in multiprocessing.get_all_start_methods())
GROUP_FAULTS = ("SIGTERM", "SIGUSR1", "SIGINT")
#: every state a stage enters while its DataLoader workers are alive, with each start method and signal (a fit
#: with SWA only in states the other fits do not signal: its pass makes its iterator after entering its state)
_SIGNALLED = {state for stage in FITS[:2] for state in WITH_WORKERS[stage]}
GROUP_CELLS = [(stage, state, context, fault) for stage in STAGES for state in sorted(WITH_WORKERS[stage])
               if stage != "fit_swa" or state not in _SIGNALLED for context in CONTEXTS for fault in GROUP_FAULTS]
#: every state a fit enters (the stages that write files a resume continues from)
KILL_CELLS = [(stage, state) for stage in FITS for state in sorted(ENTERED[stage])]
_rng = random.Random(SAMPLE_SEED)
GROUP_SELECTED = GROUP_CELLS if FULL else [_rng.choice([cell for cell in GROUP_CELLS if cell[2] == context])
                                           for context in CONTEXTS]  # one cell with each start method
KILL_SELECTED = KILL_CELLS if FULL else sorted(random.Random(SAMPLE_SEED).sample(KILL_CELLS, 1))


def _target(mode, stage, state, occurrence, fault, context, folder, out):
    """Run the target in a session of its own (the job's process group); (return code, stderr)."""
    proc = subprocess.Popen([sys.executable, str(TARGET), mode, stage, state, str(occurrence), fault, context,
                             str(folder), str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "MATRIX_THREADS": str(torch.get_num_threads())})
    try:
        _, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the {mode} run of {stage} at {state} did not end within 300 s:\n{stderr[-3000:]}")
    return proc.returncode, stderr


def _tracebacks_of_the_run(stderr: str) -> list[str]:
    """The tracebacks in `stderr`, less those of multiprocessing's resource tracker: with spawn workers it runs
    in the job's process group too, and a SIGUSR1 that ended it makes its relaunch print KeyErrors (the
    documented note in the snapshots guide); they are not the run's."""
    chunks = stderr.split("Traceback (most recent call last):")[1:]
    return [chunk for chunk in chunks if "multiprocessing/resource_tracker.py" not in chunk.split("\n", 2)[1]]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "state", "context", "fault"), GROUP_SELECTED)
def test_the_job_signalled_with_workers_in_any_state_of_any_stage_ends_in_a_documented_outcome(
        stage, state, context, fault, tmp_path, tmp_path_factory):
    """The signal reaches the whole process group (the stage's DataLoader workers too) on entering `state`: in a
    fit a listened signal ends it with `Preempted` and a snapshot whose resume ends as the uninterrupted fit;
    SIGINT rolls back (the stage run again gives the uninterrupted result); elsewhere SIGTERM and SIGUSR1
    have their default effect and end the process. Never torch's worker error."""
    reference, _ = _reference(stage, tmp_path_factory)
    alive = WITH_WORKERS[stage][state]
    occurrence = alive[1] if len(alive) >= 2 else alive[0]
    out = tmp_path / "out.pt"
    code, stderr = _target("group", stage, state, occurrence, fault, context, tmp_path / "snap", out)
    number = getattr(signal, fault)
    assert "exited unexpectedly" not in stderr and not _tracebacks_of_the_run(stderr), stderr[-3000:]
    if fault != "SIGINT" and stage not in FITS:
        assert code == -number and not out.exists(), stderr[-3000:]
        _report(stage, state, f"group-{context}-{fault}", "ended by the signal")
        return
    assert code == 0, stderr[-3000:]
    record = torch.load(out, weights_only=False)
    assert record["injected"] and record["idle"]
    if fault == "SIGINT":
        assert record["outcome"] == "rolled back"
    else:
        assert record["outcome"] == "preempted" and record["code"] == 128 + number
        assert record["snapshot_written"]
    assert states_equal(record["result"], reference)
    _report(stage, state, f"group-{context}-{fault}", record["outcome"])


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "state"), KILL_SELECTED)
def test_a_fit_killed_in_any_state_resumes_from_its_last_file_to_the_uninterrupted_end(stage, state, tmp_path,
                                                                                      tmp_path_factory):
    """SIGKILL on entering `state` (a snapshot after every update, nothing written at the kill): a new process
    with `resume=True` continues from the last file and ends bit-identical to the uninterrupted fit."""
    reference, entered = _reference(stage, tmp_path_factory)
    occurrence = 2 if entered[state] >= 2 else 1
    out = tmp_path / "out.pt"
    code, stderr = _target("kill", stage, state, occurrence, "SIGKILL", "none", tmp_path / "snap", out)
    assert code == -signal.SIGKILL and not out.exists(), stderr[-3000:]
    code, stderr = _target("resume", stage, state, 0, "SIGKILL", "none", tmp_path / "snap", out)
    assert code == 0, stderr[-3000:]
    assert states_equal(torch.load(out, weights_only=False)["result"], reference)
    _report(stage, state, "SIGKILL", "resumed")


# ---- 2-process DDP (gloo): a sampled subset of the cells, the fault on one rank ------------------------------
DDP_STAGES = ("fit", "fit_by_updates", "test", "predict")
DDP_CELLS = [(stage, state, fault, rank) for stage in DDP_STAGES for state in sorted(ENTERED[stage])
             for fault in FAULTS for rank in ("0", "1")]
DDP_SELECTED = sorted(random.Random(SAMPLE_SEED).sample(DDP_CELLS, 12 if FULL else 1))
_DDP_REFERENCE: dict = {}


def _launch_cell(monkeypatch, **variables):
    """`launch(ddp_cell, 2)` with the cell's variables (the unset ones cleared), bounded in time."""
    for name in DDP_VARIABLES:
        monkeypatch.setenv(name, variables.get(name.removeprefix("DDP_").lower(), ""))
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return launch_with_deadline(ddp_cell, 240)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("stage", "state", "fault", "rank"), DDP_SELECTED)
def test_a_fault_on_one_ddp_rank_in_any_state_ends_in_a_documented_outcome(stage, state, fault, rank, tmp_path,
                                                                         monkeypatch):
    """Under `launch` with 2 gloo ranks, the fault on one rank on entering `state`: a signal listened for in
    a fit stops both ranks with `Preempted` and the resumed 2-rank run ends as the uninterrupted one; any
    other fault (a signal after the fit: its default effect) ends the group with `DistributedError` naming
    the faulted rank."""
    if stage not in _DDP_REFERENCE:
        _DDP_REFERENCE[stage] = _launch_cell(monkeypatch, stage=stage)
    reference = _DDP_REFERENCE[stage]
    if not reference["entered"][state]:
        pytest.skip(f"{stage} does not enter {state} under 2 ranks (each rank's share of the data differs)")
    occurrence = str(2 if reference["entered"][state] >= 2 else 1)
    cell = {"stage": stage, "state": state, "occurrence": occurrence, "fault": fault, "rank": rank,
            "folder": str(tmp_path / "snap")}
    # the machine's rest state is entered once the fit ended and its previous handlers are back
    if stage in FITS and fault in ("SIGTERM", "SIGUSR1") and state != SPEC.initial:
        with pytest.raises(Preempted) as info:
            _launch_cell(monkeypatch, **cell)
        assert info.value.code == 128 + getattr(signal, fault) and info.value.path.is_file()
        resumed = _launch_cell(monkeypatch, **cell, resume="1")
        assert states_equal(resumed["result"], reference["result"])
        _report(stage, state, f"ddp-rank{rank}-{fault}", "preempted")
        return
    with pytest.raises(DistributedError) as info:
        _launch_cell(monkeypatch, **cell)
    expected = {"exception": f"injected on rank {rank} entering {state}", "SIGINT": f"rank {rank} was interrupted"}
    message = str(info.value)
    assert expected.get(fault, f"rank {rank} of 2 died with signal {fault}") in message, message[-3000:]
    assert message.startswith(f"launch: rank {rank} of 2"), message[-3000:]  # the faulted rank, not its peer
    _report(stage, state, f"ddp-rank{rank}-{fault}", "distributed error")
