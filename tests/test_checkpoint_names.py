"""Optimizer states load by parameter name: a reordered parameter list gets each parameter's own states,
a renamed or regrouped one is refused naming the parameters, and a file without names loads by position
with a warning that says so; in single files and sharded folders alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checkpoint_helpers import regression_batches, save_sharded
from torch import nn

from deepepochs import CheckCallback, Trainer, checkpoint
from deepepochs.errors import CheckpointError, DeepEpochsWarning


class EncDec(nn.Module):
    """Two layers of the same shapes: torch's positional mapping would swap their states silently."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.relu(self.dec(torch.relu(self.enc(x)))))


def _trainer(tmp_path, groups, epochs=1, seed=0) -> Trainer:
    torch.manual_seed(seed)
    model = EncDec()
    for name, module in model.named_children():  # a layer of no group is frozen (not trained by mistake)
        module.requires_grad_(name in dict(groups))
    opt = torch.optim.Adam([{"params": list(getattr(model, name).parameters()), "lr": lr} for name, lr in groups])
    return Trainer(model, F.mse_loss, opt, epochs=epochs, device="cpu", log_batch=False, show_info=False,
                   callbacks=[CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=tmp_path / "c")])


def _by_name(trainer) -> dict:
    """Each parameter's Adam state and its group's lr, by parameter name (read from the live optimizer)."""
    opt = trainer.opt[0].opt
    out = {}
    for name, param in trainer.raw_model.named_parameters():
        group = next(g for g in opt.param_groups if any(p is param for p in g["params"]))
        state = opt.state.get(param, {})
        out[name] = ({k: v.clone() for k, v in state.items()}, group["lr"])
    return out


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        (sa, lra), (sb, lrb) = a[name], b[name]
        assert lra == lrb, name
        assert sa.keys() == sb.keys(), name
        for key in sa:
            assert torch.equal(sa[key], sb[key]), (name, key)


SAVED = [("enc", 1e-2), ("dec", 1e-3), ("head", 3e-3)]
REORDERED = [("dec", 1e-3), ("head", 3e-3), ("enc", 1e-2)]


@pytest.mark.parametrize("form", ["file", "sharded"])
def test_param_groups_listed_in_another_order_get_their_own_states_and_learning_rates(tmp_path, form):
    """Saved with groups enc, dec, head and resumed with dec, head, enc: every parameter gets the Adam moments
    and the learning rate it had (compared by name with the saving optimizer), though enc and dec have the
    same shapes."""
    source = _trainer(tmp_path, SAVED)
    source.fit(regression_batches())
    path = tmp_path / "c" / source.running_id / "train-loss.latest.ckpt"
    if form == "sharded":
        path = save_sharded(source, tmp_path / "sharded.ckpt")
    expected = _by_name(source)
    target = _trainer(tmp_path, REORDERED, seed=1)
    target.load_checkpoint(path)
    _assert_same(_by_name(target), expected)
    target.fit(regression_batches(), epochs=2)  # and it trains on
    assert target.loop.completed_epochs == 2


def test_a_file_of_other_parameters_is_refused_naming_them(tmp_path):
    """An optimizer saved over enc and resumed over dec (same count and shapes): refused, naming both sides,
    and nothing is loaded."""
    source = _trainer(tmp_path, [("enc", 1e-2)])
    source.fit(regression_batches())
    target = _trainer(tmp_path, [("dec", 1e-2)], seed=1)
    before = {k: v.clone() for k, v in target.raw_model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"optimizer 0 \(Adam\) holds the states of parameters \['enc\.bias',"
                                              r" 'enc\.weight'\], which this model does not have.*lacks \['dec\.bias',"
                                              r" 'dec\.weight'\]"):
        target.load_checkpoint(tmp_path / "c" / source.running_id / "train-loss.latest.ckpt")
    assert all(torch.equal(v, before[k]) for k, v in target.raw_model.state_dict().items())


def test_the_same_parameters_in_other_groups_are_refused_naming_the_group(tmp_path):
    """Saved as groups {enc}, {dec} and resumed as {enc.weight, dec.weight}, {enc.bias, dec.bias}: no saved group
    holds exactly a live group's parameters, so the hyper-parameters cannot be placed: refused."""
    source = _trainer(tmp_path, [("enc", 1e-2), ("dec", 1e-3)])
    source.fit(regression_batches())
    torch.manual_seed(1)
    model = EncDec()
    model.head.requires_grad_(False)
    opt = torch.optim.Adam([{"params": [model.enc.weight, model.dec.weight]},
                            {"params": [model.enc.bias, model.dec.bias]}])
    target = Trainer(model, F.mse_loss, opt, device="cpu", log_batch=False, show_info=False)
    with pytest.raises(CheckpointError, match=r"param group 0 holds parameters \['enc\.weight', 'dec\.weight'\] here,"
                                              r" but no param group of the file holds exactly those"):
        target.load_checkpoint(tmp_path / "c" / source.running_id / "train-loss.latest.ckpt")


def test_a_file_without_parameter_names_loads_by_position_with_a_warning(tmp_path):
    """A file written before names were recorded (no `param_names`): its states go to the parameters by
    position, as torch maps them, and a warning says so."""
    source = _trainer(tmp_path, SAVED)
    source.fit(regression_batches())
    path = tmp_path / "c" / source.running_id / "train-loss.latest.ckpt"
    data = torch.load(path, weights_only=True)
    del data["param_names"]
    torch.save(data, tmp_path / "old.ckpt")
    target = _trainer(tmp_path, SAVED, seed=1)
    with pytest.warns(DeepEpochsWarning, match=r"old\.ckpt records no parameter names .*by position"):
        target.load_checkpoint(tmp_path / "old.ckpt")
    positional = target.opt[0].opt.state_dict()["state"]
    for pid, state in data["optimizers"][0]["state"].items():
        assert all(torch.equal(positional[pid][k], v) for k, v in state.items())


def test_damaged_parameter_names_are_refused_naming_the_field(tmp_path):
    """`param_names` that is not one list of names per optimizer: CheckpointError naming the field and type."""
    source = _trainer(tmp_path, SAVED)
    source.fit(regression_batches())
    data = torch.load(tmp_path / "c" / source.running_id / "train-loss.latest.ckpt", weights_only=True)
    data["param_names"] = [5]
    torch.save(data, tmp_path / "bad.ckpt")
    with pytest.raises(CheckpointError, match=r"bad\.ckpt: field 'param_names' must be a list of one list of parameter"
                                              r" names .*\(got a list of 1 \(int\)\)"):
        _trainer(tmp_path, SAVED).load_checkpoint(tmp_path / "bad.ckpt")


def test_every_checkpoint_records_each_optimizers_parameter_names(tmp_path):
    """A file's `param_names` are the model's names of each optimizer's parameters in its index order."""
    source = _trainer(tmp_path, REORDERED)
    source.fit(regression_batches())
    data = torch.load(tmp_path / "c" / source.running_id / "train-loss.latest.ckpt", weights_only=True)
    assert data["param_names"] == [["dec.weight", "dec.bias", "head.weight", "head.bias", "enc.weight", "enc.bias"]]
    assert checkpoint.read_checkpoint(tmp_path / "c" / source.running_id / "train-loss.latest.ckpt").param_names \
        == data["param_names"]
