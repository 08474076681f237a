"""Batch handling: the per-loop splitter must agree with `prepare_batch` on every batch shape."""

import pytest
import torch

from deepepochs.data.batch_rules import batch_splitter, lookahead, prepare_batch

X, Y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
BATCHES = {
    "pair": (X, Y),
    "list pair": [X, Y],
    "scalar label": (X, torch.tensor(1)),
    "three inputs": (X, X, Y),
    "dict input": ({"a": X}, Y),
    "nested label": (X, (Y, Y)),
    "float label": (X, Y.float()),
    "inputs only": X,
    "tensor subclass": (torch.nn.Parameter(X), Y),
}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and type(a) is type(b) and a.device == b.device and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("has_loss", [True, False])
@pytest.mark.parametrize("size_fn", [None, lambda x, y: 7])
@pytest.mark.parametrize("name", list(BATCHES))
def test_the_splitter_returns_what_prepare_batch_returns(name, size_fn, has_loss):
    batch = BATCHES[name]
    cpu = torch.device("cpu")
    try:
        expected = prepare_batch(batch, has_loss, cpu, False, size_fn)
    except Exception as e:  # the splitter must fail the same way
        with pytest.raises(type(e)):
            batch_splitter(has_loss, cpu, False, size_fn)(batch)
        return
    got = batch_splitter(has_loss, cpu, False, size_fn)(batch)
    assert _same(got, expected)


def test_the_splitter_moves_pairs_that_are_not_on_the_device():
    """The device check is real both ways (the meta device stands in for an accelerator): CPU tensors go to
    another device, and the CPU splitter does not pass a pair from elsewhere through unmoved (copying
    out of meta raises, which shows it tried)."""
    x, y, n = batch_splitter(True, torch.device("meta"), False)((X, Y))
    assert x.device.type == y.device.type == "meta" and n == 4
    meta = (torch.empty(4, 3, device="meta"), torch.empty(4, dtype=torch.long, device="meta"))
    with pytest.raises(NotImplementedError):
        batch_splitter(True, torch.device("cpu"), False)(meta)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7])
def test_lookahead_reads_ahead_except_at_a_windows_end(n):
    """For data of unknown length with windows of 3: every item but each 3rd is yielded with the next one
    read (so the data's last is known before it runs); each 3rd is yielded without it, so at a window's
    end nothing of the next window has been read."""
    read = []

    def data():
        for i in range(n):
            read.append(i)
            yield i

    got = [(item, is_last, len(read)) for item, is_last in lookahead(data(), 3)]
    want = []
    for i in range(n):
        closes_by_count = (i + 1) % 3 == 0
        want.append((i, not closes_by_count and i == n - 1, i + 1 if closes_by_count else min(i + 2, n)))
    assert got == want
