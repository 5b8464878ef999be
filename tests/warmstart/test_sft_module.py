"""SFTModule: the loss against an independent computation, the schedule, clipping, a real Trainer."""

import lightning as L
import pytest
import torch

from ais_lightning.modules.sft import SFTModule, encode_pairs, warmup_factor
from tests.warmstart.helpers import make_policy


def test_warmup_factor_values():
    assert [warmup_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0 and warmup_factor(7, 1) == 1.0
    with pytest.raises(ValueError, match="step"):
        warmup_factor(-1, 4)
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_factor(0, -1)


def test_encode_pairs_layout(tokenizer):
    p_ids, p_mask, r_ids, r_mask = encode_pairs(tokenizer, ["1+2=", "10+20="], ["3", "30"])
    assert p_ids.shape == (2, 6) and r_ids.shape == (2, 3)
    assert p_mask.tolist() == [[False, False, True, True, True, True], [True] * 6]  # left-padded
    assert r_mask.tolist() == [[True, True, False], [True, True, True]]  # answer + EOS, right-padded
    assert r_ids[0, 1].item() == tokenizer.eos_token_id and r_ids[1, 2].item() == tokenizer.eos_token_id
    assert tokenizer.decode(r_ids[1, :2].tolist()) == "30"


def test_sft_loss_is_the_mean_nll_of_answer_and_eos(tokenizer):
    policy = make_policy(0)
    module = SFTModule(policy, tokenizer)
    prompts, answers = ["12+34=", "5+6="], ["46", "11"]
    loss = module.sft_loss({"prompt": prompts, "solution": answers})
    nll = []  # independent: one unpadded forward per pair through the HF model, log-softmax, gather
    for prompt, answer in zip(prompts, answers):
        p = tokenizer.encode(prompt, add_special_tokens=False)
        r = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        with torch.no_grad():
            logits = policy.model(torch.tensor([p + r])).logits[0].double()  # [L, V]
        logp = logits.log_softmax(-1)[len(p) - 1 : len(p) + len(r) - 1]  # [len(r), V]: predicts each r token
        nll += (-logp.gather(-1, torch.tensor(r)[:, None])).squeeze(-1).tolist()
    assert loss.item() == pytest.approx(sum(nll) / len(nll), rel=1e-5)


def test_train_step_sets_lr_and_clips(tokenizer):
    policy = make_policy(0)
    module = SFTModule(policy, tokenizer, lr=0.1, grad_clip=0.05)
    opt = module.build_optimizer()
    batch = {"prompt": ["12+34=", "5+6="], "solution": ["46", "11"]}
    loss = module.train_step(opt, batch, lr=0.02)
    assert opt.param_groups[0]["lr"] == 0.02 and loss > 0
    norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in policy.parameters() if p.grad is not None])
    )
    # the random model's gradient norm is far above 0.05 (checked below): clipped to exactly 0.05
    assert norm.item() == pytest.approx(0.05, rel=1e-4)
    unclipped = SFTModule(make_policy(0), tokenizer, grad_clip=0.0)
    unclipped.train_step(unclipped.build_optimizer(), batch, lr=0.02)
    raw = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in unclipped.policy.parameters() if p.grad is not None])
    )
    assert raw.item() > 1.0


@pytest.mark.parametrize(
    "kwargs, message",
    [({"lr": 0.0}, "lr"), ({"warmup_steps": -1}, "warmup_steps"), ({"grad_clip": -1.0}, "grad_clip")],
)
def test_bad_arguments(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SFTModule(make_policy(0), tokenizer, **kwargs)


def test_fits_under_a_trainer_with_warmup_and_clipping(tokenizer, task):
    from ais_lightning.tasks import PromptDataModule

    policy = make_policy(0)
    module = SFTModule(policy, tokenizer, lr=1e-3, warmup_steps=4, grad_clip=1.0)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=PromptDataModule(task, train_size=8, val_size=0, batch_size=4))
    assert trainer.global_step == 2
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(1e-3 * 3 / 4)  # warm-up factor of step 2 after 2 scheduler steps
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())
