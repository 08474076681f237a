"""What a transactional `optimizer.step()` would cost: a copy of the parameters and the optimizer state
taken before every update (to be put back when `step()` raises part-way), against the update itself.

For each model size, Adam on the CPU with one thread: the median time of one full training step
(forward, backward, step), of `step()` alone, and of the copy (`torch._foreach_copy_` of parameters and
Adam's two moments and step counts into preallocated buffers: the cheapest form, which also doubles the
memory those tensors take).

    python benchmarks/transactional_step.py
"""

import statistics
import time

import torch


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(width: int, depth: int, batch: int = 32, repeats: int = 50) -> dict:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(depth)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width), torch.randn(batch, width)

    def train_step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    train_step()  # creates Adam's state
    params = [p for p in model.parameters()]
    live = params + [s[k] for p in params for s in (opt.state[p],) for k in ("exp_avg", "exp_avg_sq", "step")]
    backup = [t.detach().clone() for t in live]

    def copy():
        with torch.no_grad():
            torch._foreach_copy_(backup, live)

    def step_only():
        opt.step()

    numel = sum(p.numel() for p in params)
    return {"parameters": numel, "train_step_us": _median_us(train_step, repeats),
            "step_us": _median_us(step_only, repeats), "copy_us": _median_us(copy, repeats),
            "extra_memory_mb": sum(t.numel() * t.element_size() for t in backup) / 2**20}


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'parameters':>12} {'train step µs':>14} {'step() µs':>10} {'copy µs':>9} {'copy/step':>10}"
          f" {'copy/train':>11} {'extra MB':>9}")
    for width, depth in ((16, 2), (256, 4), (1024, 8), (2048, 12)):
        r = measure(width, depth, repeats=50 if width < 2048 else 10)
        print(f"{r['parameters']:>12,} {r['train_step_us']:>14.0f} {r['step_us']:>10.0f} {r['copy_us']:>9.0f}"
              f" {r['copy_us'] / r['step_us']:>10.2f} {r['copy_us'] / r['train_step_us']:>11.2f}"
              f" {r['extra_memory_mb']:>9.1f}")


if __name__ == "__main__":
    main()
