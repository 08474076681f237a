"""Where the rest of a training stream cannot be saved, the resume warning says why and what to do: the
stateful protocol for a dataset without it, torchdata's StatefulDataLoader for a stateful dataset behind
DataLoader workers, and the attribute of a sampler holding a generator no checkpoint keeps."""

import re

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from deepepochs import Trainer
from deepepochs.data.streams import inexact_reason, stream_holder
from deepepochs.errors import DeepEpochsWarning


class Plain(IterableDataset):
    def __iter__(self):
        for i in range(16):
            yield torch.full((4,), float(i)), i % 2


class Stateful(Plain):
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class NumpySampler(Sampler):
    """Draws its order from a NumPy generator of its own (no checkpoint keeps it)."""

    def __init__(self):
        self.rng = np.random.default_rng(0)

    def __iter__(self):
        return iter(self.rng.permutation(16).tolist())

    def __len__(self):
        return 16


class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((4,), float(i)), i % 2


@pytest.mark.parametrize(("data", "advice"), [
    (DataLoader(Plain(), batch_size=4), r"IterableDataset Plain has no state .* give it state_dict\(\) and"
                                        r" load_state_dict\(\)"),
    (DataLoader(Plain(), batch_size=4, num_workers=2), r"load it with torchdata's StatefulDataLoader, which collects"),
    (DataLoader(Stateful(), batch_size=4, num_workers=2), r"Stateful is stateful, but a DataLoader cannot read its"
                                                         r" state inside its 2 worker processes: .*num_workers=0"),
    (DataLoader(Pairs(), batch_size=4, sampler=NumpySampler()), r"NumpySampler's attribute 'rng' \(a numpy.random"
                                                               r".*Generator\) is not saved: draw from a"
                                                               r" torch.Generator held as the sampler's `generator`"),
])
def test_the_reason_names_what_the_user_can_do(data, advice):
    assert stream_holder(data) is None
    assert inexact_reason(data) is not None
    assert re.search(advice, inexact_reason(data)), inexact_reason(data)


def test_a_stateful_dataset_without_workers_and_a_fixed_order_need_no_advice():
    assert stream_holder(DataLoader(Stateful(), batch_size=4)) is not None
    assert inexact_reason(DataLoader(Pairs(), batch_size=4)) is None
    assert inexact_reason([(torch.zeros(2, 4), torch.zeros(2))]) is None


def test_a_refit_inside_an_epoch_warns_with_the_advice():
    """A fault in epoch 1 after 2 updates on a sampler drawing from NumPy: the refit iterates past the trained
    batches and says which attribute is not saved."""

    class FailOnce(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, preds, targets):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("injected")
            return torch.nn.functional.cross_entropy(preds, targets)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    trainer = Trainer(model, FailOnce(), torch.optim.SGD(model.parameters(), lr=0.1), epochs=1, device="cpu",
                      log_batch=False, show_info=False)
    data = DataLoader(Pairs(), batch_size=4, sampler=NumpySampler())
    with pytest.raises(RuntimeError, match="injected"):
        trainer.fit(data)
    with pytest.warns(DeepEpochsWarning, match=r"first 2 batches are iterated past.*To resume exactly: the sampler"
                                               r" NumpySampler's attribute 'rng'"):
        trainer.fit(data)
    trainer.close()
