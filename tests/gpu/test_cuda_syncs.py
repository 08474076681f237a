"""Host synchronisations per training batch on CUDA, counted by torch's sync debug mode; skipped without CUDA.

In steady state a training batch must not make the host wait for the device (a `.item()`, a blocking copy
to the host): with the console off, fp32 and bf16 keep the non-finite flag on the device until the task's
end (nonfinite='raise'), and fp16 reads the GradScaler's inf flags once per update, as torch's own
`GradScaler.step` does in a plain loop, which is the reference. Per-fit reads (the epoch's loss, the end
of the task's check) cancel: the count is taken as (syncs of an n2-batch fit - those of an n1-batch fit)
/ (n2 - n1).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepepochs import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N1, N2 = 4, 12
SYNC_WARNING = "synchronizing CUDA operation"


def batches(n: int) -> list:
    """`n` pre-batched (x, y) pairs already on the GPU, so that no host-to-device copy is counted."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(32, 16, generator=g).cuda(), torch.randint(0, 2, (32,), generator=g).cuda())
            for _ in range(n)]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)).cuda()


def count_syncs(run) -> int:
    """How many synchronising CUDA calls `run()` makes (torch's sync debug mode, one warning each)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(SYNC_WARNING in str(w.message) for w in caught)


def per_batch(fit) -> float:
    """Synchronisations per batch of `fit(data)`, after a warm-up fit of each length."""
    data = {n: batches(n) for n in (N1, N2)}
    for n in (N1, N2):
        fit(data[n])
    counts = [count_syncs(lambda n=n: fit(data[n])) for n in (N1, N2)]
    return (counts[1] - counts[0]) / (N2 - N1)


def deepepochs_fit(precision: str):
    net = model()
    trainer = Trainer(net, F.cross_entropy, torch.optim.Adam(net.parameters(), lr=1e-3), device="cuda",
                      precision=precision, log_batch=False, show_info=False)
    epochs = [0]

    def fit(data):
        epochs[0] += 1
        trainer.fit(data, epochs=epochs[0])

    return fit


def raw_fp16_fit():
    """The plain loop under fp16 autocast with torch's GradScaler: what a GradScaler costs by itself."""
    net = model()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")

    def fit(data):
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(net(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    return fit


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_cuda_training_batch_makes_no_host_sync_in_steady_state(precision):
    """fp32 and bf16, console off: no training batch waits for the device (the finite flag stays there)."""
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    assert per_batch(deepepochs_fit(precision)) == 0


def test_a_cuda_fp16_batch_syncs_no_more_than_torchs_grad_scaler_loop():
    """fp16, console off: a batch syncs only as often as a plain GradScaler loop does (its inf read)."""
    raw = per_batch(raw_fp16_fit())
    ours = per_batch(deepepochs_fit("fp16"))
    assert ours <= raw, (ours, raw)
