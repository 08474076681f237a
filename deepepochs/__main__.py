"""deepepochs on the command line.

- `python -m deepepochs graph --format mermaid|dot|png|svg [--level fit|epoch|task|batch|full] [--output FILE]`:
  draw the loop machine, one level at a time; `--flight FILE` draws a saved flight record's last
  transitions as a numbered path (a log holding the error's note, or JSON from `save_flight_record`);
  `--profile FILE` draws a profiled run's trace (`ProfileCallback(trace=FILE)`) as a heat map.
- `python -m deepepochs loop [--precision fp32|fp16|bf16] [--processes N] [--clip]`: print the code a
  training micro-batch runs for that configuration (generated from the loop spec), each line with its edge.
- `python -m deepepochs consolidate SOURCE TARGET`: write a sharded checkpoint folder (saved under
  `strategy='fsdp'`) as one checkpoint file, which any trainer loads, in one process too.
"""

from __future__ import annotations

import argparse
import shutil
import sys

from deepepochs.errors import CheckpointError, ConfigError
from deepepochs.fsm.machine import load_spec
from deepepochs.fsm.render import FORMATS, LEVELS, auto_level, render

__all__ = ["main"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepepochs", description="deepepochs tools")
    sub = parser.add_subparsers(dest="command", required=True)
    graph = sub.add_parser("graph", help="draw the training-loop state machine")
    graph.add_argument("--format", choices=FORMATS, default="mermaid")
    graph.add_argument("--output", "-o", help="file to write (default: stdout; required for png/svg)")
    graph.add_argument("--show-interrupts", action="store_true", help="draw every interrupt edge")
    graph.add_argument("--level", choices=LEVELS, default=None,
                       help="fit (default: a fit as epochs), epoch (stages, tasks), task (windows), batch (one"
                            " micro-batch), full (every state); with --flight: the level of the failed state")
    graph.add_argument("--flight", metavar="FILE", help="draw the last transitions of a saved flight record"
                       " (the log of a failed run, or JSON from deepepochs.save_flight_record)")
    graph.add_argument("--last", type=int, default=12, metavar="N", help="with --flight: how many of the last"
                       " transitions to number (default 12)")
    graph.add_argument("--profile", metavar="FILE", help="shade each state by its share of a profiled run's time"
                       " (the trace of ProfileCallback(trace=FILE)); the level of the hottest state")
    loop = sub.add_parser("loop", help="print the code a training micro-batch runs for a configuration")
    loop.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32")
    loop.add_argument("--processes", type=int, default=1, help="world size (DDP processes)")
    loop.add_argument("--clip", action="store_true", help="a gradient clipper is attached (GradClipCallback)")
    merge = sub.add_parser("consolidate", help="write a sharded checkpoint folder as one checkpoint file")
    merge.add_argument("source", help="the sharded checkpoint folder (e.g. checkpoints/<run>/val-loss.best.ckpt)")
    merge.add_argument("target", help="the checkpoint file to write (replaced atomically if it exists)")
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        return _consolidate(args.source, args.target)
    if args.command == "loop":
        from deepepochs.engine.compiled import describe  # noqa: PLC0415 (graph needs none of the engine)
        if args.processes < 1:
            parser.error(f"--processes must be >= 1 (got {args.processes})")
        sys.stdout.write(describe(args.precision, args.processes, args.clip))
        return 0
    if args.format in ("png", "svg") and not args.output:
        parser.error(f"--format {args.format} needs --output FILE")
    if args.format in ("png", "svg") and shutil.which("dot") is None:
        # A missing system tool is not a bug of the caller's: one line saying what to do, no traceback.
        print(f"deepepochs graph: --format {args.format} needs Graphviz's 'dot' program, which is not on PATH;"
              " install Graphviz (e.g. `apt-get install graphviz`, `brew install graphviz` or"
              " `conda install graphviz`), or use --format dot or --format mermaid", file=sys.stderr)
        return 2
    if args.last < 1:
        parser.error(f"--last must be at least 1 (got {args.last})")
    records, level = [], args.level or "fit"
    if args.flight:
        from deepepochs.fsm.flight import read_flight_record  # noqa: PLC0415 (only --flight reads one)
        try:
            records = read_flight_record(args.flight)[-args.last:]
        except ConfigError as e:  # a bad file is the caller's to fix: one line, no traceback
            print(f"deepepochs graph: {e}", file=sys.stderr)
            return 2
        failed = [r.source for r in records if r.trigger == load_spec().interrupt]
        if args.level is None:
            level = auto_level(load_spec(), failed[-1] if failed else records[-1].dest)
    heat = None
    if args.profile:
        from deepepochs.reporting.profile_report import read_profile, state_shares  # noqa: PLC0415
        try:
            heat = state_shares(read_profile(args.profile))
        except ConfigError as e:
            print(f"deepepochs graph: {e}", file=sys.stderr)
            return 2
        if args.level is None:
            level = auto_level(load_spec(), max(heat, key=heat.get))
    out = render(args.format, path=records, show_interrupts=args.show_interrupts, level=level, heat=heat)
    if args.output:
        with open(args.output, "wb" if isinstance(out, bytes) else "w") as f:
            f.write(out)
    else:
        sys.stdout.write(out)
    return 0


def _consolidate(source: str, target: str) -> int:
    from deepepochs.checkpoint import consolidate  # noqa: PLC0415 (graph needs none of it)
    try:
        path = consolidate(source, target)
    except CheckpointError as e:  # a bad folder is the caller's to fix: one line, no traceback
        print(f"deepepochs consolidate: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
