"""Users coming from other libraries: their names for our arguments (Lightning's `max_epochs`,
`accumulate_grad_batches`, `gradient_clip_val`, `precision='16-mixed'`) and an optimizer class where an
instance belongs get errors that name our argument or the fix."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepepochs import ConfigError, Optimizer, Trainer


@pytest.mark.parametrize("kwargs, ours", [
    ({"max_epochs": 3}, "'max_epochs' (did you mean epochs=?)"),
    ({"accumulate_grad_batches": 4}, "'accumulate_grad_batches' (did you mean gradient_accumulation_steps=?)"),
    ({"gradient_clip_val": 1.0},
     "'gradient_clip_val' (did you mean callbacks=[GradClipCallback(max_norm, norm_type=2)]"),
    ({"epoch": 3}, "'epoch' (did you mean epochs=?)"),  # a typo: the closest of our names
    ({"max_steps": 1000}, "'max_steps' (did you mean max_updates=?)"),
    ({"val_check_interval": 500}, "'val_check_interval' (did you mean fit(val_every_n_updates=...)?)"),
])
def test_other_libraries_keywords_name_our_argument(kwargs, ours):
    """An unknown Trainer keyword is a TypeError naming it and our argument for it."""
    with pytest.raises(TypeError, match="Trainer\\(\\) got unexpected keyword argument") as info:
        Trainer(nn.Linear(2, 2), F.cross_entropy, **kwargs)
    assert ours in str(info.value)


@pytest.mark.parametrize("theirs, ours", [("16-mixed", "'fp16'"), ("bf16-mixed", "'bf16'"), ("32-true", "'fp32'"),
                                          (16, "'fp16'")])
def test_lightning_precision_names_are_mapped_to_ours_in_the_error(theirs, ours):
    """precision='bf16-mixed' says to use 'bf16' (not the generic 'fp16' hint)."""
    with pytest.raises(ConfigError, match=r"precision must be one of 'fp32', 'fp16', 'bf16'") as info:
        Trainer(nn.Linear(2, 2), F.cross_entropy, precision=theirs)
    assert f"(got {theirs!r}); {theirs!r} is another library's name: use {ours}" in str(info.value)


def test_an_unknown_precision_keeps_the_general_hint():
    with pytest.raises(ConfigError, match=r"\(got 'half'\); use 'fp16' for float16 autocast"):
        Trainer(nn.Linear(2, 2), F.cross_entropy, precision="half")


@pytest.mark.parametrize("make", [lambda: Trainer(nn.Linear(2, 2), F.cross_entropy, torch.optim.AdamW),
                                  lambda: Trainer(nn.Linear(2, 2), F.cross_entropy, [torch.optim.AdamW]),
                                  lambda: Optimizer(torch.optim.AdamW)])
def test_an_optimizer_class_instead_of_an_instance_says_how_to_make_one(make):
    with pytest.raises(ConfigError, match=r"got the class AdamW, not an instance: pass an instance, e\.g\."
                                          r" AdamW\(model\.parameters\(\)\)"):
        make()


@pytest.mark.parametrize("pack", [lambda opt, sched: (opt, sched), lambda opt, sched: [opt, sched],
                                  lambda opt, sched: sched], ids=["tuple", "list", "scheduler alone"])
def test_a_scheduler_beside_its_optimizer_is_refused_naming_optimizer_with_both(pack):
    """`Trainer(model, loss, (opt, sched))`, the pair other libraries take, is refused before training with
    an error naming `Optimizer(opt, sched)`, the way a scheduler goes with its optimizer here."""
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(ConfigError, match=r"got the learning-rate scheduler StepLR: give a scheduler with its"
                                          r" optimizer as Optimizer\(opt, sched\) \(from deepepochs import"
                                          r" Optimizer\), e\.g\. Trainer\(model, loss, Optimizer\(opt, sched\)\)"):
        Trainer(net, F.cross_entropy, pack(opt, sched))
