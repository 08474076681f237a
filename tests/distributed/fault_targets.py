"""Target for the DDP fault tests: a 2-process fit in which rank 1 raises on entering a chosen state."""

import os

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Trainer

STATE_ENV = "DEEPEPOCHS_TEST_FAULT_STATE"


def fail_on_rank_1() -> None:
    """Rank 1 raises on the 2nd entry into $DEEPEPOCHS_TEST_FAULT_STATE; rank 0 trains on."""
    state = os.environ[STATE_ENV]
    torch.manual_seed(0)
    x = torch.randn(96, 6)
    y = (x[:, 0] > 0).long()
    model = nn.Linear(6, 2)
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=20,
                      device="cpu", gradient_accumulation_steps=2, log_batch=False, show_info=False,
                      fuse_steps=False)  # every edge, so the probe sees the micro-batch's inner states
    seen = []

    def probe(dest):
        if dest == state and trainer.world_size == 2 and int(os.environ["RANK"]) == 1:
            seen.append(dest)
            if len(seen) == 2:
                raise RuntimeError(f"injected on rank 1 entering {state}")

    trainer.machine.probe = probe
    try:
        trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8),
                    DataLoader(TensorDataset(x[:30], y[:30]), batch_size=8))
    finally:
        trainer.close()
