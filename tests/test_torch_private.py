"""torch_private: each private-torch helper on the installed torch, and its public fallback, against plain torch."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from deepepochs import ConfigError
from deepepochs import torch_private as tp
from deepepochs.training.precision import Precision

CPU = torch.device("cpu")
SCALER_PATHS = ["private", "fallback"]


@pytest.fixture(params=SCALER_PATHS)
def scaler_path(request, monkeypatch):
    """Run the test once on the private `_per_optimizer_states` path and once on the public fallback."""
    if request.param == "private":
        assert tp.scaler_records_private(), "the private scaler path is unavailable on this torch"
    monkeypatch.setattr(tp, "SCALER_RECORDS_PRIVATE", request.param == "private")
    return request.param


def make_scaler(scale=256.0, growth_interval=2000):
    return torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=growth_interval)


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def two_optimizers(model):
    """One SGD over each linear layer (two halves of the model, as a GAN's two players would be)."""
    return [torch.optim.SGD(model[i].parameters(), lr=0.1) for i in (0, 2)]


def backward(model, scaler, poison=None, seed=0):
    """Scaled backward of a fixed batch; `poison` (a layer index) gets an inf gradient in its weight."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, generator=g)
    if poison is not None:
        handle = model[poison].weight.register_hook(lambda grad: torch.full_like(grad, math.inf))
    scaler.scale(model(x).square().mean()).backward()
    if poison is not None:
        handle.remove()


def grads_finite(optimizer):
    """Reference: every gradient of `optimizer` is finite (plain torch.isfinite)."""
    return all(torch.isfinite(p.grad).all() for g in optimizer.param_groups for p in g["params"])


def found(flags):
    return any(float(f) != 0.0 for f in flags)


# ---- feature detection ----
def test_the_private_paths_are_available_on_the_installed_torch():
    """The import-time probes find the private layouts on this torch (else every run uses the fallback:
    update torch_private, or drop the private path if torch now offers a public one)."""
    assert tp.scaler_records_private()
    assert tp.AUTOCAST_ENABLED_PRIVATE
    assert tp._RUN_BACKWARD is not None  # backward_seeded's engine call
    has_device_query = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 4)
    assert tp.AUTOCAST_QUERY_PUBLIC == has_device_query


def test_all_lists_exactly_the_public_functions_and_each_resolves():
    """`__all__` names callables that exist, and every public function of the module is in it."""
    assert all(callable(getattr(tp, name)) for name in tp.__all__)
    functions = {name for name, value in vars(tp).items()
                 if callable(value) and getattr(value, "__module__", None) == tp.__name__
                 and not name.startswith("_")}
    assert functions == set(tp.__all__)


# ---- scaler_unscale ----
@pytest.mark.parametrize("poison", [None, 0, 2])
def test_scaler_unscale_flags_inf_exactly_where_the_unscaled_gradients_are_not_finite(scaler_path, poison):
    """The flags say 'found' for an optimizer iff torch.isfinite finds a non-finite unscaled gradient, and
    the gradients are divided by the scale like plain `unscale_` does."""
    model, ref = make_model(), make_model()
    scaler, ref_scaler = make_scaler(), make_scaler()
    backward(model, scaler, poison)
    backward(ref, ref_scaler, poison)
    for opt, ref_opt in zip(two_optimizers(model), two_optimizers(ref)):
        flags = tp.scaler_unscale(scaler, opt)
        ref_scaler.unscale_(ref_opt)
        assert len(flags) == 1 and flags[0].dtype == torch.float32
        assert found(flags) == (not grads_finite(ref_opt))
        for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
            for p, q in zip(group["params"], ref_group["params"]):
                assert torch.equal(p.grad, q.grad)


def test_scaler_unscale_returns_no_flag_for_an_optimizer_without_gradients(scaler_path):
    """An optimizer none of whose parameters got a gradient has an empty record (nothing to check)."""
    model, scaler = make_model(), make_scaler()
    scaler.scale(torch.ones(()))  # initialises the scale, as a first loss would
    assert tp.scaler_unscale(scaler, two_optimizers(model)[0]) == []


# ---- scaler_forget / scaler_forget_all ----
def test_scaler_forget_hands_back_the_flags_and_allows_a_second_unscale_without_a_scale_update(scaler_path):
    """forget returns the optimizer's flags, leaves scale and growth tracker alone, and the optimizer may
    be unscaled again (plain torch would raise 'unscale_() has already been called')."""
    model, scaler = make_model(), make_scaler()
    opt_a, opt_b = two_optimizers(model)
    backward(model, scaler, poison=0)
    before = scaler.state_dict()
    flags = tp.scaler_unscale(scaler, opt_a)
    record = tp.scaler_forget(scaler, opt_a, CPU)
    assert [float(f) for f in record] == [float(f) for f in flags] == [1.0]
    assert tp.scaler_forget(scaler, opt_b, CPU) is None  # never unscaled: no record
    assert scaler.state_dict() == before
    tp.scaler_unscale(scaler, opt_a)  # allowed again
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt_a)  # the new record still guards against a double unscale


def test_scaler_forget_all_lets_every_optimizer_be_unscaled_again_and_keeps_the_scale(scaler_path):
    """After an interrupted update, forget_all drops every record; the scale stays as it was."""
    model, scaler = make_model(), make_scaler()
    opts = two_optimizers(model)
    backward(model, scaler)
    for opt in opts:
        tp.scaler_unscale(scaler, opt)
    before = scaler.state_dict()
    tp.scaler_forget_all(scaler, CPU)
    assert scaler.state_dict() == before
    for opt in opts:
        scaler.unscale_(opt)  # would raise if a record were left


def test_scaler_forget_all_on_a_fresh_scaler_then_loading_a_state_restores_that_state(scaler_path):
    """A checkpoint load into a never-used scaler: forget_all first, then load_state_dict, then the loaded
    scale is the one the next loss is multiplied by."""
    saved = make_scaler(scale=64.0).state_dict() | {"_growth_tracker": 3}
    scaler = make_scaler()
    tp.scaler_forget_all(scaler, CPU)
    scaler.load_state_dict(saved)
    assert scaler.state_dict() == saved
    assert scaler.scale(torch.tensor(1.0)).item() == 64.0


# ---- scaler_update_with ----
@pytest.mark.parametrize("poisoned", [{1, 2}, {0, 3, 4, 7}, set()])
def test_scaler_update_with_set_aside_records_follows_plain_step_and_update(scaler_path, poisoned):
    """Iterations of two optimizers whose records are set aside, then applied in one update, give the
    scale and growth tracker of plain `scaler.step(a); scaler.step(b); scaler.update()` (growth included)."""
    model, ref = make_model(), make_model()
    scaler, ref_scaler = make_scaler(growth_interval=2), make_scaler(growth_interval=2)
    opts, ref_opts = two_optimizers(model), two_optimizers(ref)
    for it in range(8):
        poison = 2 if it in poisoned else None
        backward(model, scaler, poison, seed=it)
        backward(ref, ref_scaler, poison, seed=it)
        records = []
        for opt in opts:
            tp.scaler_unscale(scaler, opt)
            records.append(tp.scaler_forget(scaler, opt, CPU))
            opt.zero_grad()
        tp.scaler_update_with(scaler, records)
        for opt in ref_opts:
            ref_scaler.step(opt)
            opt.zero_grad()
        ref_scaler.update()
        assert scaler.state_dict() == ref_scaler.state_dict(), it


def test_scaler_update_with_also_consumes_a_record_still_held(scaler_path):
    """A still-unscaled optimizer's inf counts in the update, like plain update() over all records; its
    record is consumed, so it may be unscaled again."""
    model, scaler = make_model(), make_scaler()
    opt_a, opt_b = two_optimizers(model)
    backward(model, scaler, poison=2)  # only opt_b's layer overflows
    tp.scaler_unscale(scaler, opt_a)
    tp.scaler_unscale(scaler, opt_b)  # unscaled, not forgotten
    record_a = tp.scaler_forget(scaler, opt_a, CPU)
    assert not found(record_a)
    tp.scaler_update_with(scaler, [record_a])
    assert scaler.get_scale() == 128.0
    assert tp.scaler_forget(scaler, opt_b, CPU) is None
    scaler.unscale_(opt_b)  # its record is gone: allowed


# ---- through Precision ----
def reference_run(poisoned):
    """Plain torch: per batch, backward, scaler.step of each optimizer (skipping on inf), one update."""
    model, scaler = make_model(), make_scaler(growth_interval=3)
    opts = two_optimizers(model)
    scales, steps = [], []
    for it in range(8):
        backward(model, scaler, 0 if it in poisoned else None, seed=it)
        for opt in opts:
            scaler.unscale_(opt)
            steps.append(grads_finite(opt))
            scaler.step(opt)
            opt.zero_grad()
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, steps, [p.detach().clone() for p in model.parameters()]


def precision_run(poisoned, halves):
    """The same batches through Precision: unscale, step where finite, finish (both at once or in two
    halves, the second half deferring nothing because every optimizer then has finished)."""
    precision = Precision("fp16", CPU)
    precision.scaler.load_state_dict(make_scaler(growth_interval=3).state_dict())
    model = make_model()
    opts = two_optimizers(model)
    scales, steps = [], []
    for it in range(8):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(it))
        if it in poisoned:
            handle = model[0].weight.register_hook(lambda grad: torch.full_like(grad, math.inf))
        precision.scale(model(x).square().mean(), token=it).backward()
        if it in poisoned:
            handle.remove()
        groups = [[opts[0]], [opts[1]]] if halves else [opts]
        for group in groups:
            finite = precision.unscale(group)
            for opt, ok in zip(group, finite):
                steps.append(ok)
                if ok:
                    opt.step()
                opt.zero_grad()
            precision.finish(group, len(opts), token=it)
        scales.append(precision.scaler.get_scale())
    return scales, steps, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("halves", [False, True])
def test_precision_decides_and_scales_like_plain_torch_on_either_path(scaler_path, halves):
    """Precision's step/skip decisions, scales and final weights equal a plain GradScaler loop, with the
    optimizers finished together or one at a time, on the private path and on the fallback."""
    poisoned = {1, 2, 6}
    scales, steps, params = precision_run(poisoned, halves)
    ref_scales, ref_steps, ref_params = reference_run(poisoned)
    assert steps == ref_steps and scales == ref_scales
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)


def test_precision_discards_an_interrupted_update_on_either_path(scaler_path):
    """discard_step_state after an unscale leaves the scale alone and lets the next update unscale."""
    precision = Precision("fp16", CPU)
    model = make_model()
    opts = two_optimizers(model)
    precision.scale(model(torch.ones(2, 3)).sum(), token=0).backward()
    precision.unscale(opts)
    before = precision.scaler.state_dict()
    precision.discard_step_state()
    assert precision.scaler.state_dict() == before
    assert precision.unscale(opts) == [True, True]


# ---- autocast_enabled ----
def autocast_cases():
    """(label, autocast context) for CPU: working bf16, float64 that torch disables, explicitly off."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float64: "not supported ... Disabling autocast"
        return [("bf16", torch.autocast("cpu", dtype=torch.bfloat16)),
                ("float64", torch.autocast("cpu", dtype=torch.float64)),
                ("off", torch.autocast("cpu", dtype=torch.bfloat16, enabled=False))]


def public_reference(ctx):
    """Reference: enter the context and ask torch's public per-device query."""
    with ctx:
        return torch.is_autocast_enabled("cpu")


@pytest.mark.skipif(not tp.AUTOCAST_QUERY_PUBLIC, reason="the public reference needs torch >= 2.4")
@pytest.mark.parametrize("path", ["public", "private"])
def test_autocast_enabled_tells_a_working_autocast_from_one_torch_disabled(monkeypatch, path):
    """bf16 on CPU is on, float64 (disabled by torch with a warning) and enabled=False are off; the
    private `_enabled` path answers as the public query does."""
    monkeypatch.setattr(tp, "AUTOCAST_QUERY_PUBLIC", path == "public")
    answers = {label: tp.autocast_enabled(ctx, "cpu") for label, ctx in autocast_cases()}
    assert answers == {label: public_reference(ctx) for label, ctx in autocast_cases()}
    assert answers == {"bf16": True, "float64": False, "off": False}


@pytest.mark.skipif(not tp.AUTOCAST_QUERY_PUBLIC, reason="the public query needs torch >= 2.4")
def test_asking_whether_autocast_is_enabled_leaves_autocast_off_afterwards():
    """The public query enters and leaves the context: autocast is as it was (off) afterwards."""
    for _, ctx in autocast_cases():
        tp.autocast_enabled(ctx, "cpu")
        assert not torch.is_autocast_enabled("cpu")


def test_without_any_autocast_query_precision_still_rejects_an_autocast_torch_disabled(monkeypatch):
    """Fallback: autocast_enabled reports on, and Precision's check of torch's warning still turns a
    disabled autocast into a ConfigError."""
    monkeypatch.setattr(tp, "AUTOCAST_QUERY_PUBLIC", False)
    monkeypatch.setattr(tp, "AUTOCAST_ENABLED_PRIVATE", False)
    assert all(tp.autocast_enabled(ctx, "cpu") for _, ctx in autocast_cases())
    real = torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda device_type, dtype=None, **kw: real(device_type,
                                                                                    dtype=torch.float64))
    with pytest.raises(ConfigError, match=r"precision='fp16' is not supported by autocast on cpu"):
        Precision("fp16", CPU)


@pytest.mark.parametrize("path", ["private", "public"])
@pytest.mark.parametrize("where", [None, "inf", "nan", "float64", "sparse"])
def test_grads_nonfinite_flags_exactly_when_some_gradient_is_not_finite(monkeypatch, path, where):
    """One flag over gradients of two dtypes and a sparse one, against `torch.isfinite` per gradient; the
    values are left as they were (the fused check runs with a scale of 1)."""
    if path == "private":
        assert tp._probe_grads_check()
    monkeypatch.setattr(tp, "GRADS_CHECK_PRIVATE", path == "private")
    grads = [torch.randn(3, 2), torch.randn(5), torch.randn(4, dtype=torch.float64),
             torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,), check_invariants=True)]
    if where in ("inf", "nan"):
        grads[1][2] = math.inf if where == "inf" else math.nan
    elif where == "float64":
        grads[2][0] = math.nan
    elif where == "sparse":
        grads[3] = torch.sparse_coo_tensor([[0, 2]], [1.0, math.inf], (4,), check_invariants=True)
    before = [g.clone() for g in grads]
    expected = not all(torch.isfinite(g.to_dense()).all() for g in grads)
    flag = tp.grads_nonfinite(grads)
    assert flag.dtype == torch.float32 and flag.numel() == 1
    assert (float(flag) != 0.0) == expected == (where is not None)
    # the fused check; the sums of every gradient; the sums of the two over 4 elements, the others fused
    for summed, least in ((False, 1), (True, 1), (True, 5)):
        monkeypatch.setattr(tp, "SUM_CHECK_MIN_NUMEL", least)
        assert tp.grads_finite_on_host(grads, summed) is (not expected)
        assert tp.grads_finite_on_host([torch.ones(2)], summed)  # the reused flag starts over
    for g, b in zip(grads, before):
        assert torch.equal(g.to_dense().nan_to_num(posinf=9.0), b.to_dense().nan_to_num(posinf=9.0))


def test_summed_gradients_that_overflow_or_cancel_are_checked_exactly(monkeypatch):
    """The read-only path for large gradients adds their sums: finite values past the dtype's range (a
    non-finite total) are still finite gradients, +inf and -inf (a NaN total) are not, and complex
    gradients (a complex total) are checked exactly, as the fused check's fallback checks them."""
    monkeypatch.setattr(tp, "SUM_CHECK_MIN_NUMEL", 1)  # these small gradients summed too
    big = torch.full((8,), 60000.0, dtype=torch.float16)
    assert not math.isfinite(big.sum().item()) and tp.grads_finite_on_host([big, torch.ones(3)], summed=True)
    assert not tp.grads_finite_on_host([torch.tensor([math.inf, 1.0]), torch.tensor([-math.inf])], summed=True)
    for summed in (True, False):
        assert tp.grads_finite_on_host([torch.ones(2, dtype=torch.complex64), torch.ones(2)], summed)
        assert not tp.grads_finite_on_host([torch.ones(2), torch.tensor([complex(0, math.inf)])], summed)
        assert not tp.grads_finite_on_host([torch.tensor([1 + 1j, complex(math.nan, 0)])], summed)


def test_sums_pay_off_for_gradients_large_on_average():
    """The check sums gradients averaging SUM_CHECK_MEAN_NUMEL elements or more (the sums' cost grows with
    the number of gradients, the fused check's with their size); the trainer's optimizers decide once."""
    n = tp.SUM_CHECK_MEAN_NUMEL
    assert tp.sums_pay_off([torch.ones(n), torch.ones(n)]) and tp.sums_pay_off([torch.ones(2 * n - 1), torch.ones(1)])
    assert not tp.sums_pay_off([torch.ones(2 * n - 2), torch.ones(1)]) and not tp.sums_pay_off([])
    from deepepochs.training.optim import Optimizers

    wide, narrow = torch.nn.Linear(256, 256), torch.nn.Linear(16, 2)
    assert Optimizers(torch.optim.SGD(wide.parameters(), lr=0.1), wide).sum_check
    assert not Optimizers(torch.optim.SGD(narrow.parameters(), lr=0.1), narrow).sum_check


# ---- FSDP2's unsynced gradients ----
@pytest.fixture
def one_rank_group():
    """A one-process gloo group in this process (fully_shard needs a group), destroyed afterwards."""
    import torch.distributed as dist
    import torch.distributed.fsdp

    if not hasattr(torch.distributed.fsdp, "fully_shard"):
        pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6")

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp_drop_unsynced_grads_leaves_only_the_next_synchronised_backward(one_rank_group):
    """A no-sync backward leaves gradients inside FSDP (not in `.grad`); after the drop, a synchronising
    backward gives exactly the gradients of that backward alone, as plain torch computes them."""
    from torch.distributed.fsdp import fully_shard

    model, plain = make_model(), make_model()
    fully_shard(model[0])
    fully_shard(model)
    assert tp.fsdp_unsynced_grads_private(model)
    first, second = torch.randn(5, 3), torch.randn(5, 3)
    model.set_requires_gradient_sync(False)
    model(first).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # held inside FSDP, out of zero_grad's reach
    tp.fsdp_drop_unsynced_grads(model)
    model.set_requires_gradient_sync(True)
    model(second).sum().backward()
    plain(second).sum().backward()
    for sharded, reference in zip(model.parameters(), plain.parameters()):
        assert torch.equal(sharded.grad.full_tensor(), reference.grad)


def test_without_the_drop_the_unsynced_gradients_would_reach_the_next_window(one_rank_group):
    """The leak the drop prevents: without it the synchronising backward adds the earlier gradients."""
    from torch.distributed.fsdp import fully_shard

    model, plain = make_model(), make_model()
    fully_shard(model)
    first, second = torch.randn(5, 3), torch.randn(5, 3)
    model.set_requires_gradient_sync(False)
    model(first).sum().backward()
    model.set_requires_gradient_sync(True)
    model(second).sum().backward()
    plain(second).sum().backward()
    assert any(not torch.allclose(s.grad.full_tensor(), r.grad) for s, r in zip(model.parameters(), plain.parameters()))


def test_the_fsdp_probe_says_no_for_a_model_without_fully_shard():
    """No FSDP records to reach (an unsharded model, or a torch whose layout changed): the fallback."""
    assert not tp.fsdp_unsynced_grads_private(make_model())


@pytest.mark.parametrize("path", ["private", "fallback"])
@pytest.mark.parametrize("share", [1.0, 0.25])
def test_backward_seeded_gives_the_gradients_of_the_public_backward_bit_for_bit(monkeypatch, path, share):
    """backward_seeded, private engine call or public fallback, accumulates what torch.autograd.backward does."""
    if path == "fallback":
        monkeypatch.setattr(tp, "_RUN_BACKWARD", None)
    torch.manual_seed(0)
    ours, theirs = nn.Linear(5, 3), nn.Linear(5, 3)
    theirs.load_state_dict(ours.state_dict())
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for _ in range(2):  # the second backward adds to the first's gradients
        loss = nn.functional.cross_entropy(ours(x), y)
        tp.backward_seeded(loss, torch.full_like(loss, share))
        torch.autograd.backward(nn.functional.cross_entropy(theirs(x), y), torch.full_like(loss, share))
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_backward_seeded_rejects_a_loss_that_does_not_require_grad_as_torch_does():
    """A loss without a graph raises torch's own RuntimeError through the private engine call too."""
    loss = torch.tensor(1.0)
    with pytest.raises(RuntimeError, match="does not require grad"):
        tp.backward_seeded(loss, torch.ones_like(loss))
