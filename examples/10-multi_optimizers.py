"""Several optimizers in one step: a tiny GAN that learns a 1-D Gaussian N(3, 0.5).

The trainer gets a list of optimizers; a custom `train_step` computes each loss with
`self.loss(..., do_optimize=False)` (forward value + backward) and updates one optimizer with
`self.optimize(optimize_index=i)`. Index 0 is the discriminator's optimizer, 1 the generator's.

Run: `python examples/10-multi_optimizers.py` (or `--small` for a few seconds' run).
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import TrainerBase, ValuePatch, set_seed

NOISE = 4


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(NOISE, 32), nn.ReLU(), nn.Linear(32, 1))
        self.discriminator = nn.Sequential(nn.Linear(1, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, z):
        return self.generator(z)


class GANTrainer(TrainerBase):
    def train_step(self, batch_x, batch_y, **step_args):
        gan = self.raw_model
        real, ones = batch_x, batch_y
        zeros = torch.zeros_like(ones)
        fake = self.model(torch.randn(real.shape[0], NOISE, device=real.device))

        # Discriminator (optimizer 0): real -> 1, fake -> 0; the fake is detached so G gets no gradient.
        d_out = gan.discriminator(torch.cat([real, fake.detach()]))
        d_loss = self.loss(d_out, torch.cat([ones, zeros]), do_optimize=False)
        self.optimize(optimize_index=0)

        # Generator (optimizer 1): make D say 1 for the fake. D is frozen so this backward leaves its
        # gradients alone (they would otherwise leak into D's next update).
        gan.discriminator.requires_grad_(False)
        g_loss = self.loss(gan.discriminator(fake), ones, do_optimize=False)
        gan.discriminator.requires_grad_(True)
        self.optimize(optimize_index=1)
        n = real.shape[0]
        return {"d_loss": ValuePatch(d_loss, n), "g_loss": ValuePatch(g_loss, n)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (512, 2) if args.small else (4096, 15)
    set_seed(0)
    real = 3.0 + 0.5 * torch.randn(n, 1)
    train_dl = DataLoader(TensorDataset(real, torch.ones(n, 1)), batch_size=64, shuffle=True)
    gan = GAN()
    opt_d = torch.optim.Adam(gan.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(gan.generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    with GANTrainer(gan, F.binary_cross_entropy_with_logits, [opt_d, opt_g], epochs=epochs,
                    log_batch=False) as trainer:
        trainer.fit(train_dl)
        with torch.no_grad():
            samples = gan(torch.randn(4096, NOISE))
    print(f"generated samples: mean {samples.mean():.3f} (target 3.0), std {samples.std():.3f} (target 0.5)")


if __name__ == "__main__":
    main()
