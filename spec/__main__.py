"""`python -m spec [--check]`: render the loop spec into the package's generated tables."""

import argparse
import sys
from pathlib import Path

from deepepochs.engine.actions import FOLDS
from deepepochs.engine.compiled import generate_all
from deepepochs.fsm.codegen import write_or_check
from spec.loop import SPEC

#: The configurations whose compiled micro-batch `docs/micro-batch.md` shows: (title, actions left out).
SHOWN = (
    ("fp32, one process, no gradient clipper (the default)", {name: why for name, (_, why) in FOLDS.items()}, False),
    ("fp16 under DDP with a gradient clipper (nothing left out)", {}, True),
)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m spec", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the generated files are stale")
    args = parser.parse_args()
    package = Path(__file__).resolve().parent.parent / "deepepochs"
    code = {title: generate_all(folded, autocast, SPEC) for title, folded, autocast in SHOWN}
    stale = write_or_check(SPEC, package, check=args.check, code=code)
    for path in stale:
        verb = "stale" if args.check else "wrote"
        print(f"{verb}: {path.relative_to(package.parent)}")
    if args.check and stale:
        print("generated tables differ from spec/loop.py: run `make gen` and commit the result")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
