"""FSM dispatch cost: µs per hot trigger (`LoopMachine.fire`), per cold trigger (`fire_cold`, through
`transitions`), and per training batch's hot triggers: the eight edges fired one by one, and the same
batch as the code compiled from its fused edge runs it (`deepepochs.engine.compiled`: the state moves, the
guard it asks and the recorded edge), with no-op guards, actions and step pieces so only dispatch is
measured. Run alone (`python benchmarks/fsm_dispatch.py`) or from loop_overhead.py.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median  # noqa: E402

from deepepochs.engine import compiled  # noqa: E402
from deepepochs.fsm.machine import LoopMachine, load_spec  # noqa: E402

__all__ = ["FUSED_BATCH_EDGE", "TRAIN_BATCH_TRIGGERS", "measure"]

#: The hot triggers one training batch fires with one optimizer and no accumulation (see spec/loop.py).
TRAIN_BATCH_TRIGGERS = ("begin_window", "begin_batch", "backward", "optimize", "clip", "apply_update",
                        "finish_update", "end_batch")
#: The fused edge those eight hops make (the default without accumulation or per-batch callbacks).
FUSED_BATCH_EDGE = "window_step"


class _Position:
    """What the flight recorder reads: `epoch` and `batch_idx` attributes (or a call returning both)."""

    epoch = 1
    batch_idx = 1

    def __call__(self):
        return self.epoch, self.batch_idx


def _machine(flags: dict) -> LoopMachine:
    spec = load_spec()
    # Guards not listed in `flags` are False (the plain path: e.g. no resume pending).
    guards = {g.name: (lambda name=g.name: flags.get(name, False)) for g in spec.guards}
    actions = {a.name: (lambda: None) for a in spec.actions}
    return LoopMachine(guards, actions, _Position())


def _compiled_batch(machine: LoopMachine):
    """The generated one-batch window (`FUSED_BATCH_EDGE`'s source state) for fp32 in one process, with
    no-op actions, guards (true) and step pieces: a call costs what the generated code's own lines do."""
    spec = load_spec()
    source = [f for f in spec.transitions if f.trigger == FUSED_BATCH_EDGE][0].source
    namespace = {g.name: (lambda ctx: True) for g in spec.guards}
    namespace.update({a.name: (lambda ctx: None) for a in spec.actions})
    namespace.update({name: (lambda *args: None) for name in compiled.STEP_HELPERS})
    namespace.update(read_batch=lambda *args: (None, None, 1), count_batch=lambda *args: (None, None))
    exec(compile(compiled.generate(source, {}, False), "<fsm_dispatch>", "exec"), namespace)  # noqa: S102
    run = namespace[compiled.function_name(source)]
    ctx = types.SimpleNamespace(loop=types.SimpleNamespace(update_indices=(0,), opt_index=0), machine=machine)
    return lambda: run(ctx, None, None, None, True)


def _enter(machine: LoopMachine, *triggers: str) -> None:
    """Walk the machine along `triggers`: cold ones through `transitions`, hot ones (`validate`, which the
    update clock fires per update) on the compiled table."""
    hot = {t.name for t in machine.spec.triggers if t.hot}
    for trigger in triggers:
        (machine.fire if trigger in hot else machine.fire_cold)(trigger)


def _time_per_call(fn, calls: int, repeats: int) -> float:
    """Median over `repeats` of the µs per call of `fn`, which performs `calls` calls per invocation."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return median(samples)


def measure(n: int = 20000, repeats: int = 5) -> dict:
    """Dispatch costs in µs; `n` triggers (or batches) per repeat."""
    flags = {"epochs_remaining": True, "stop_requested": False, "val_due": True, "window_boundary": True,
             "grads_finite": True, "has_save_requests": False}

    # Hot, unguarded and action-free: a validation batch's begin_batch/end_batch pair.
    m = _machine(flags)
    _enter(m, "fit", "next_epoch", "begin_train", "begin_task")
    for trigger in TRAIN_BATCH_TRIGGERS:  # one training batch, then leave to the validation stage
        m.fire(trigger)
    _enter(m, "end_task", "end_stage", "validate", "begin_task")
    fire = m.fire

    def hot_pairs():
        for _ in range(n // 2):
            fire("begin_batch")
            fire("end_batch")

    hot = _time_per_call(hot_pairs, 2 * (n // 2), repeats)

    # Cold: end_task/begin_task between the validation stage and its task, through `transitions`.
    cold_n = max(n // 20, 200)
    fire_cold = m.fire_cold

    def cold_pairs():
        for _ in range(cold_n // 2):
            fire_cold("end_task")
            fire_cold("begin_task")

    cold = _time_per_call(cold_pairs, 2 * (cold_n // 2), repeats)

    def per_batch(fused: bool):
        """One training batch's hot triggers, with their guards (window_boundary, grads_finite)."""
        t = _machine(flags)
        _enter(t, "fit", "next_epoch", "begin_train", "begin_task")
        batches = n // len(TRAIN_BATCH_TRIGGERS)
        hop = t.fire
        compiled_batch = _compiled_batch(t) if fused else None

        def train_batches():
            for _ in range(batches):
                if fused:
                    compiled_batch()
                    continue
                for trigger in TRAIN_BATCH_TRIGGERS:
                    hop(trigger)

        return _time_per_call(train_batches, batches, repeats)

    unfused, fused = per_batch(False), per_batch(True)

    # Baseline: a bare Python method call, the floor of any dispatch.
    class _Obj:
        def noop(self, _trigger):
            return None

    noop = _Obj().noop

    def bare():
        for _ in range(n):
            noop("x")

    bare_call = _time_per_call(bare, n, repeats)
    return {
        "hot_fire_us": hot,
        "cold_fire_us": cold,
        "train_batch_triggers": list(TRAIN_BATCH_TRIGGERS),
        "train_batch_dispatch_us": unfused,
        "fused_batch_edge": FUSED_BATCH_EDGE,
        "fused_batch_dispatch_us": fused,
        "bare_method_call_us": bare_call,
        "triggers_per_repeat": n,
        "repeats": repeats,
    }


def format_table(result: dict) -> str:
    rows = [
        ("`LoopMachine.fire` (hot, compiled table)", result["hot_fire_us"]),
        ("`LoopMachine.fire_cold` (cold, `transitions`)", result["cold_fire_us"]),
        (f"one training batch, every edge ({len(result['train_batch_triggers'])} hot triggers)",
         result["train_batch_dispatch_us"]),
        (f"the same batch as its compiled code ({result['fused_batch_edge']})",
         result["fused_batch_dispatch_us"]),
        ("bare Python method call (floor)", result["bare_method_call_us"]),
    ]
    lines = ["| dispatch | µs |", "|---|---:|"]
    lines += [f"| {name} | {value:.2f} |" for name, value in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=20000, help="triggers per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(format_table(measure(args.n, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
