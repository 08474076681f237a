"""`Trainer(strategy=..., fsdp_kwargs=...)` in one process: every argument is checked with a
message naming it, the accepted values and what came; one process accepts strategy='fsdp' and trains
exactly as the default; the wrapping policy picks the submodules it promises. The two-process behaviour
is in `tests/distributed/test_fsdp.py`."""

import pytest
import torch
import torch.distributed.fsdp
from torch import nn
from torch.nn import functional as F

if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6", allow_module_level=True)

from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402 (after the skip above)

from deepepochs import ConfigError, Trainer  # noqa: E402
from deepepochs.parallel.fsdp import FSDP_KEYS, FSDPConfig, shard_targets  # noqa: E402
from deepepochs.parallel.single import SingleProcess  # noqa: E402

X = torch.randn(24, 4, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()
DATA = [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 24, 8)]


def _trainer(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), epochs=2,
                   device="cpu", log_batch=False, show_info=False, **kw)


ACCEPTED = "; ".join(f"{key!r}: {what}" for key, what in FSDP_KEYS.items())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"strategy": "deepspeed"},
     "strategy must be one of 'ddp', 'fsdp' (got 'deepspeed'); 'fsdp' shards the model with FSDP2 (fully_shard)"),
    ({"strategy": "ddp", "fsdp_kwargs": {"min_params": 10}},
     "fsdp_kwargs applies to strategy='fsdp' only (got strategy='ddp' and fsdp_kwargs={'min_params': 10}); pass"
     " strategy='fsdp' or leave fsdp_kwargs out"),
    ({"strategy": "fsdp", "ddp_kwargs": {"find_unused_parameters": True}},
     "ddp_kwargs applies to strategy='ddp' only (got strategy='fsdp' and ddp_kwargs={'find_unused_parameters':"
     f" True}}); FSDP's options go in fsdp_kwargs: {ACCEPTED}"),
    ({"strategy": "fsdp", "fsdp_kwargs": [("min_params", 10)]},
     f"fsdp_kwargs must be None or a dict with the keys {ACCEPTED} (got [('min_params', 10)])"),
    ({"strategy": "fsdp", "fsdp_kwargs": {"min_param": 10, "auto_wrap_policy": None}},
     f"fsdp_kwargs has unknown keys ['auto_wrap_policy', 'min_param']; accepted keys: {ACCEPTED}"),
    ({"strategy": "fsdp", "fsdp_kwargs": {"wrap": "Linear"}},
     f"fsdp_kwargs['wrap'] must be {FSDP_KEYS['wrap']} (got 'Linear')"),
    ({"strategy": "fsdp", "fsdp_kwargs": {"wrap": [nn.Linear, int]}},
     f"fsdp_kwargs['wrap'] must be {FSDP_KEYS['wrap']} (got (<class 'torch.nn.modules.linear.Linear'>, <class"
     " 'int'>))"),
    ({"strategy": "fsdp", "fsdp_kwargs": {"min_params": 0}},
     f"fsdp_kwargs['min_params'] must be {FSDP_KEYS['min_params']} (got 0)"),
    ({"strategy": "fsdp", "fsdp_kwargs": {"min_params": 1e6}},
     f"fsdp_kwargs['min_params'] must be {FSDP_KEYS['min_params']} (got 1000000.0)"),
    ({"strategy": "fsdp", "fsdp_kwargs": {"reshard_after_forward": "yes"}},
     f"fsdp_kwargs['reshard_after_forward'] must be {FSDP_KEYS['reshard_after_forward']} (got 'yes')"),
    ({"strategy": "fsdp", "fsdp_kwargs": {"reshard_after_forward": 0}},
     f"fsdp_kwargs['reshard_after_forward'] must be {FSDP_KEYS['reshard_after_forward']} (got 0)"),
    ({"strategy": "fsdp", "fsdp_kwargs": {"mixed_precision": torch.bfloat16}},
     f"fsdp_kwargs['mixed_precision'] must be {FSDP_KEYS['mixed_precision']} (got dtype); e.g."
     " MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"),
])
def test_bad_strategy_arguments_are_config_errors_naming_the_argument(kwargs, message):
    """Each mistake fails at construction, in one process too, with the exact message."""
    with pytest.raises(ConfigError) as info:
        _trainer(**kwargs)
    assert str(info.value) == message


def test_good_fsdp_arguments_are_accepted_and_kept():
    """Every key with a valid value: a list of classes becomes a tuple; the record is frozen."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    config = FSDPConfig(wrap=[nn.Linear], min_params=5, reshard_after_forward=False, mixed_precision=policy)
    assert config.wrap == (nn.Linear,) and config.min_params == 5 and config.reshard_after_forward is False
    assert config.mixed_precision is policy
    with pytest.raises(AttributeError):
        config.min_params = 6


def test_one_process_accepts_strategy_fsdp_and_trains_exactly_as_the_default():
    """With one process the strategy makes no difference: same policy, bit-identical weights and records."""
    results = []
    for kwargs in ({}, {"strategy": "fsdp", "fsdp_kwargs": {"wrap": nn.Linear, "reshard_after_forward": False}}):
        with _trainer(gradient_accumulation_steps=2, **kwargs) as trainer:
            assert type(trainer._dist) is SingleProcess
            records = trainer.fit(DATA, DATA)
            results.append((records, [p.detach().clone() for p in trainer.raw_model.parameters()]))
    (records_a, weights_a), (records_b, weights_b) = results
    assert records_a == records_b
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))


class _Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inner = nn.Linear(width, width)  # width * (width + 1) parameters
        self.norm = nn.LayerNorm(width)  # 2 * width

    def forward(self, x):
        return self.norm(self.inner(x))


def _tower():
    return nn.Sequential(_Block(10), _Block(3), nn.Linear(3, 1))  # blocks of 110 + 20 and 12 + 6 parameters


def test_the_default_wrapping_policy_shards_bottom_up_by_parameter_count():
    """min_params=100: the big block's Linear (110) is sharded alone; the rest (its LayerNorm's 20, the
    small block's 18, the head's 4) is left to the root. min_params=15: both parts of the big block are
    sharded (110, 20), which leaves its block nothing; the small block's parts are too small (12, 6) but
    the block together (18) is sharded."""
    tower = _tower()
    assert shard_targets(tower, FSDPConfig(min_params=100)) == [tower[0].inner]
    picked = shard_targets(tower, FSDPConfig(min_params=15))
    assert picked == [tower[0].inner, tower[0].norm, tower[1]]
    assert tower not in shard_targets(tower, FSDPConfig(min_params=1))  # the caller shards the root last


def test_a_class_or_callable_wrapping_policy_picks_those_modules_children_first():
    """wrap=_Block shards both blocks; a callable picks what it accepts; children come before parents."""
    tower = _tower()
    assert shard_targets(tower, FSDPConfig(wrap=_Block)) == [tower[1], tower[0]]
    picked = shard_targets(tower, FSDPConfig(wrap=lambda m: isinstance(m, (_Block, nn.Linear))))
    assert picked.index(tower[0].inner) < picked.index(tower[0])
    assert set(map(id, picked)) == {id(m) for m in (tower[0], tower[0].inner, tower[1], tower[1].inner, tower[2])}


def test_a_wrapping_callable_must_answer_true_or_false():
    """A callable returning something else than a bool is a ConfigError naming the module it was asked about."""
    with pytest.raises(ConfigError) as info:
        shard_targets(_tower(), FSDPConfig(wrap=lambda m: 1))
    assert str(info.value) == "fsdp_kwargs['wrap'] must return True or False for a module (got 1 for Linear)"
