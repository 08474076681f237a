"""How an update is made: mixed precision and the fp16 GradScaler (`precision`), optimizers and schedulers
(`optim`), and the learning-rate finder's sweep (`lr_sweep`)."""

__all__: list[str] = []
