"""`Trainer.explain()` shows the training step that runs: the generated default step, or a custom step's own
source with the loop spec's edges its calls take."""

import inspect

import torch
from torch import nn
from torch.nn import functional as F

from deepepochs import Trainer, TrainerBase
from deepepochs.fsm.machine import load_spec

QUIET = dict(log_batch=False, show_info=False, device="cpu")


class OwnStep(TrainerBase):
    def train_step(self, batch_x, batch_y, **step_args):
        loss = F.cross_entropy(self.model(batch_x), batch_y)
        loss.backward()  # a marker line the explanation must show
        self.optimize()


def test_explain_of_a_custom_train_step_shows_its_source_and_the_spec_edges_it_takes():
    """With a train_step of its own, explain() names it, shows its source (not the default step's generated
    code) and lists every training edge of the spec that optimize can take, with its guards and error."""
    model = nn.Linear(4, 2)
    text = OwnStep(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), **QUIET).explain()
    assert "#   batches run   your OwnStep.train_step, edge by edge" in text
    assert "# The training step that runs is OwnStep.train_step (" in text
    assert inspect.getsource(OwnStep.train_step).replace("    def", "def", 1).replace("\n    ", "\n") in text
    assert "loss_value(" not in text and "backpropagate(" not in text  # the default step's generated code
    for edge in load_spec().edges("step_forward", "optimize"):
        assert f"step_forward --optimize {edge.guard_label}--> {edge.dest or '(refused)'}" in text
    assert "val_batch" not in text


def test_explain_of_the_default_step_still_shows_the_generated_code():
    """Without a step of its own the trainer's explanation is the generated micro-batch code, as before."""
    model = nn.Linear(4, 2)
    text = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), **QUIET).explain()
    assert "backpropagate(" in text and "The training step that runs is" not in text
