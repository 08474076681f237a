"""A training run for the multi-node test: started by `torchrun --nnodes=2` twice (one process per "node"),
or in one process as the reference. Writes the final weights (rank 0) to the file named by argv[1].

Two ranks take batches of 4, one process batches of 8: the same global batches (a plain DataLoader is
sharded by deepepochs in rank order), so the weights agree within float tolerance."""

import os
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Optimizer, Trainer


def main(out: str) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer(model, F.cross_entropy, Optimizer(opt, sched, sched_on="step"), epochs=3, device="cpu",
                      gradient_accumulation_steps=2, log_batch=False, show_info=False,
                      data_order="global")  # one process equals the nodes: the order every world size shares
    try:
        records = trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8 // world, shuffle=True),
                              DataLoader(TensorDataset(x[:30], y[:30]), batch_size=8))
        if trainer.is_main_process:
            torch.save({"weights": model.state_dict(), "records": records, "world_size": trainer.world_size}, out)
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1])
