"""Make docs/img/profile-heatmap.svg, the heat map of docs/guide/profiling.md's slow run (needs Graphviz).

Run from the repository root: `python docs/img/profile_heatmap.py`. The run is the page's: a dataset whose
`__getitem__` sleeps 2 ms, a small MLP, two epochs, profiled; torch runs on one thread so that the model's
share is what it is on an idle machine.
"""

import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from deepepochs import ProfileCallback, Trainer

OUT = Path(__file__).resolve().parent / "profile-heatmap.svg"


class SlowImages(Dataset):
    """256 samples whose __getitem__ takes 2 ms."""

    def __init__(self):
        self.x, self.y = torch.randn(256, 32), torch.randint(0, 4, (256,))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(0.002)
        return self.x[i], self.y[i]


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    profiler = ProfileCallback()
    trainer = Trainer(model, F.cross_entropy, torch.optim.Adam(model.parameters()), epochs=2, log_batch=False,
                      show_info=False, callbacks=[profiler])
    trainer.fit(DataLoader(SlowImages(), batch_size=32))
    trainer.state_graph("svg", path=OUT, profile=profiler)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
