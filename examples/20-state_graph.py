"""Draw the training loop's state machine: Mermaid and Graphviz DOT text always, PNG/SVG with Graphviz.

1. The static graph (also `python -m deepepochs graph --format mermaid`).
2. A live trainer: a callback draws the graph in the middle of a training step, where the current state
   and the last transitions are highlighted.
3. A crashed trainer: after an exception the graph highlights the state that failed, and the error
   carries the last transitions (the flight record).

Files go to `--out` (default: a temporary folder). Paste the `.mmd` text into https://mermaid.live.

Run: `python examples/20-state_graph.py` (or `--small`, the same here: nothing trains for long).
"""

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, Trainer


class DrawMidStep(Callback):
    """Draws the graph once, just after the first backward pass of the fit."""

    def __init__(self, out):
        self.out, self.done = out, False

    def on_after_backward(self, trainer, loss):
        if not self.done:
            self.done = True
            print(f"  live trainer is in state {trainer.machine.state!r}")
            trainer.state_graph("mermaid", path=self.out / "live.mmd")


class FailAtBatch(Callback):
    def on_before_train_forward(self, trainer):
        if trainer.loop.batch_idx == 3:
            raise RuntimeError("simulated failure in the forward pass of batch 3")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="accepted for uniformity; the run is short")
    parser.add_argument("--out", default=None, help="folder for the drawings (default: a temporary one)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="deepepochs-graph-"))
    out.mkdir(parents=True, exist_ok=True)
    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=16)

    model = nn.Linear(4, 2)
    with Trainer(model, F.cross_entropy, epochs=1, callbacks=[DrawMidStep(out)], log_batch=False,
                 show_info=False) as trainer:
        mermaid = trainer.state_graph("mermaid", path=out / "loop.mmd").read_text()  # with a path: the path
        trainer.state_graph("dot", path=out / "loop.dot")
        print("Mermaid, first lines:\n  " + "\n  ".join(mermaid.splitlines()[:6]))
        trainer.fit(data)
        if shutil.which("dot"):
            trainer.state_graph("png", path=out / "loop.png")
            trainer.state_graph("svg", path=out / "loop.svg")
        else:
            print("Graphviz 'dot' not found: PNG/SVG skipped (apt-get install graphviz / brew install graphviz)")

    crashed = Trainer(nn.Linear(4, 2), F.cross_entropy, epochs=1, callbacks=[FailAtBatch()], log_batch=False,
                      show_info=False)
    try:
        crashed.fit(data)
    except RuntimeError as e:
        print(f"fit failed as planned: {e}")
        print("  " + "\n  ".join(getattr(e, "__notes__", ["(no flight record)"])[-1].splitlines()[-4:]))
    print(f"  after rollback the trainer is {crashed.machine.state!r}; the drawing marks the failed state")
    crashed.state_graph("dot", path=out / "crashed.dot")
    if shutil.which("dot"):
        crashed.state_graph("png", path=out / "crashed.png")
    crashed.close()
    print("wrote", ", ".join(sorted(p.name for p in out.iterdir())), "to", out)


if __name__ == "__main__":
    main()
