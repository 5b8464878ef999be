"""FP16 training pieces: the dynamic loss scale against torch's GradScaler, the fp32 master weights by hand."""

from __future__ import annotations

import functools
import io

import pytest
import torch

from ais_lightning.modules.mixed_precision import (
    DynamicLossScale,
    MasterWeightOptimizer,
    build_optimizer,
    master_optimizer,
)


def test_loss_scale_follows_torch_gradscaler_on_cpu():
    """The same overflow pattern gives GradScaler's scale sequence (GradScaler runs on CPU in this torch)."""
    pattern = [True, True, False, True, True, True, True, False, False, True, True, True]
    ours = DynamicLossScale(init_scale=1024.0, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    p = torch.nn.Parameter(torch.zeros(1))
    sgd = torch.optim.SGD([p], lr=0.0)
    for finite in pattern:
        theirs.scale(torch.ones(()))  # its scale tensor is made on first use
        p.grad = torch.tensor([1.0 if finite else float("inf")])
        theirs.unscale_(sgd)
        theirs.step(sgd)
        theirs.update()
        ours.update(finite)
        assert ours.scale == theirs.get_scale()
        assert ours.growth_tracker == theirs.state_dict()["_growth_tracker"]
    # by hand: halved at steps 3, 8 and 9; doubled at steps 6 and 12 (3 finite steps in a row each)
    assert ours.scale == 1024.0 * 0.5 * 2 * 0.5 * 0.5 * 2


def test_loss_scale_rejects_bad_settings_and_round_trips():
    for bad in ({"init_scale": 0.0}, {"growth_factor": 1.0}, {"backoff_factor": 1.0}, {"growth_interval": 0}):
        with pytest.raises(ValueError):
            DynamicLossScale(**bad)
    a = DynamicLossScale(init_scale=8.0, growth_interval=5)
    a.update(True)
    a.update(False)
    a.update(True)
    b = DynamicLossScale()
    b.load_state_dict(a.state_dict())
    assert (
        b.state_dict()
        == a.state_dict()
        == {
            "scale": 4.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 5,
            "growth_tracker": 1,
        }
    )


def test_pure_fp16_adamw_breaks_where_the_masters_do_not():
    """Why master weights: AdamW on fp16 parameters keeps fp16 moments; g^2 (1 - beta2) of a 1e-3 gradient
    underflows to 0 and eps = 1e-8 rounds to 0 in fp16, so the update divides by zero."""
    grad = torch.tensor([1e-3, 1e-4], dtype=torch.float16)
    pure = torch.nn.Parameter(torch.full((2,), 0.02, dtype=torch.float16))
    adamw = torch.optim.AdamW([pure], lr=1e-5, weight_decay=0.0)
    pure.grad = grad.clone()
    adamw.step()
    assert not torch.isfinite(pure).any()

    w = torch.nn.Parameter(torch.full((2,), 0.02, dtype=torch.float16))
    opt = MasterWeightOptimizer([w], functools.partial(torch.optim.AdamW, lr=1e-5, weight_decay=0.0))
    w.grad = grad * opt.loss_scale.scale  # as after backward of the scaled loss
    opt.step()
    # Adam's first step moves every weight by lr (m / (sqrt(v) + eps) = g / (|g| + 1e-8) ~ 1), in fp32:
    master = opt.masters()[0].detach()
    start = torch.full((2,), 0.02, dtype=torch.float16).float()
    torch.testing.assert_close(master, start - 1e-5, rtol=0, atol=4e-9)
    assert torch.equal(w.detach(), master.half())


def test_master_step_by_hand_with_sgd():
    """SGD on the masters: m = p - lr * (scaled grad / scale), then p = fp16(m); the scale grows on schedule."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float16))
    scale = DynamicLossScale(init_scale=256.0, growth_interval=2)
    opt = MasterWeightOptimizer([w], functools.partial(torch.optim.SGD, lr=0.01), scale)
    assert opt.param_groups[0]["lr"] == 0.01  # the inner optimizer's hyper-parameters are visible outside
    expected = w.detach().float().clone()
    for _ in range(2):
        opt.zero_grad()
        loss = (w.float() * torch.tensor([1.0, 2.0, 3.0])).sum()  # d/dw = [1, 2, 3]
        opt.scale_loss(loss).backward()
        assert w.grad.dtype == torch.float16
        torch.testing.assert_close(w.grad.float(), torch.tensor([1.0, 2.0, 3.0]) * 256.0)  # before the step
        opt.step()
        expected -= 0.01 * torch.tensor([1.0, 2.0, 3.0])
        torch.testing.assert_close(opt.masters()[0].detach(), expected, rtol=0, atol=0)
        assert torch.equal(w.detach(), expected.half())
    assert scale.scale == 512.0  # two finite steps at growth_interval=2

    opt.param_groups[0]["lr"] = 0.0  # a schedule writes the outer groups; the inner step follows
    opt.zero_grad()
    opt.scale_loss(w.float().sum()).backward()
    opt.step()
    torch.testing.assert_close(opt.masters()[0].detach(), expected, rtol=0, atol=0)


def test_an_overflow_skips_the_step_and_backs_off():
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = MasterWeightOptimizer([w], functools.partial(torch.optim.SGD, lr=0.1))
    (w.float().sum() * 1e6).backward()  # 1e6 > fp16's max: the gradient is inf
    assert not torch.isfinite(w.grad).all()
    opt.step()
    assert torch.equal(w.detach(), torch.ones(2, dtype=torch.float16))
    assert opt.loss_scale.scale == 2.0**15 and opt.loss_scale.growth_tracker == 0
    assert all(m.grad is None for m in opt.masters()) and w.grad is None
    opt.zero_grad()
    opt.step()  # an empty step (no gradient) changes nothing, the scale included
    assert opt.loss_scale.scale == 2.0**15 and opt.loss_scale.growth_tracker == 0


def test_state_dict_resumes_exactly():
    """Masters, AdamW moments and the loss scale all come back: the resumed trajectory is bit for bit the same."""
    torch.manual_seed(0)
    grads = [torch.randn(3, 4) * 10 ** torch.randint(-6, 1, (1,)).item() for _ in range(6)]
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)

    def run(model, opt, steps):
        for g in steps:
            opt.zero_grad()
            opt.scale_loss((model.weight.float() * g).sum()).backward()
            opt.step()

    a = torch.nn.Linear(4, 3, bias=False).half()
    opt_a = MasterWeightOptimizer(
        a.parameters(), adamw, DynamicLossScale(init_scale=2.0**20, growth_interval=2)
    )
    run(a, opt_a, grads[:3])
    buffer = io.BytesIO()
    torch.save({"model": a.state_dict(), "optimizer": opt_a.state_dict()}, buffer)
    run(a, opt_a, grads[3:])

    buffer.seek(0)
    saved = torch.load(buffer)
    b = torch.nn.Linear(4, 3, bias=False).half()
    b.load_state_dict(saved["model"])
    opt_b = MasterWeightOptimizer(b.parameters(), adamw)
    opt_b.load_state_dict(saved["optimizer"])
    assert opt_b.loss_scale.state_dict() == saved["optimizer"]["loss_scale"]
    run(b, opt_b, grads[3:])
    assert torch.equal(a.weight, b.weight)
    assert torch.equal(opt_a.masters()[0], opt_b.masters()[0])
    assert opt_a.loss_scale.state_dict() == opt_b.loss_scale.state_dict()


def test_a_plain_optimizer_state_is_refused_naming_the_cause():
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = MasterWeightOptimizer([w], functools.partial(torch.optim.AdamW, lr=0.1))
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1).state_dict()
    with pytest.raises(ValueError, match="no fp32 master weights.*policy.dtype"):
        opt.load_state_dict(plain)


def test_build_optimizer_wraps_float16_parameters_only():
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    plain = build_optimizer(torch.nn.Linear(2, 2).parameters(), adamw)
    assert type(plain) is torch.optim.AdamW and master_optimizer(plain) is None
    fp16 = build_optimizer(torch.nn.Linear(2, 2).half().parameters(), adamw)
    assert master_optimizer(fp16) is fp16 and all(m.dtype == torch.float32 for m in fp16.masters())
