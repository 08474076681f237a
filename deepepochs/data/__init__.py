"""The data a run reads and returns: batch rules (`batch_rules`: splitting, device moves, sample counts),
the training order and where data goes across processes (`sampling`), and predict outputs reassembled in
dataset order (`outputs`)."""

__all__: list[str] = []
