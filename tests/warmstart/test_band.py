"""The band-stop procedure with scripted accuracies, and the greedy evaluator against HF generate."""

import pytest
import torch

from ais_lightning.app.warmstart import GreedyAccuracy, WarmStartError, state_dict_sha256, train_warm_start
from ais_lightning.modules.sft import SFTModule, warmup_factor
from ais_lightning.tasks import PromptDataModule, Task, TaskSample
from tests.warmstart.helpers import make_policy, tiny_settings


@pytest.fixture
def scripted(monkeypatch):
    """Replace the greedy evaluation by a script of accuracies; records the weights at each call."""
    calls = []

    def install(accuracies):
        def fake(self):
            calls.append(state_dict_sha256(self.policy.model))
            return accuracies[len(calls) - 1]

        monkeypatch.setattr(GreedyAccuracy, "__call__", fake)
        return calls

    return install


def replay(tokenizer, task, settings, seed, lrs):
    """Independent trajectory: SFT steps k = 0, 1, ... at the given base lrs, on the same batches."""
    policy = make_policy(0)
    module = SFTModule(policy, tokenizer, lr=settings.lr, warmup_steps=settings.warmup_steps)
    opt = module.build_optimizer()
    data = PromptDataModule(task, val_size=settings.eval_size, batch_size=settings.batch_size, seed=seed)
    stream = data.train_stream()
    for k, lr in enumerate(lrs):
        module.train_step(opt, stream.batch(0, k), lr * warmup_factor(k, settings.warmup_steps))
    return state_dict_sha256(policy.model)


def test_overshoot_backs_off_to_the_last_snapshot_with_half_lr_and_interval(
    tokenizer, task, scripted, tmp_path
):
    settings = tiny_settings(tmp_path, steps=20, target_band=[0.6, 0.8], eval_every=2, lr=1e-3)
    calls = scripted([0.1, 0.3, 0.9, 0.7])  # step 0, step 2, step 4 (over), step 3 after the back-off
    policy = make_policy(0)
    out = train_warm_start(policy, tokenizer, task, settings, seed=5, progress_bar=False)
    assert [h["step"] for h in out["history"]] == [0, 2, 4, 3]
    assert [h["steps_trained"] for h in out["history"]] == [0, 2, 4, 5]
    assert [h["lr"] for h in out["history"]] == [1e-3, 1e-3, 1e-3, 5e-4]
    assert out["accuracy"] == 0.7 and out["steps"] == 3 and out["steps_trained"] == 5 and out["backoffs"] == 1
    assert out["lr"] == 5e-4
    # steps 0-1 at lr, then step 2 again from the step-2 snapshot at lr / 2 (interval 2 -> 1)
    expected = replay(tokenizer, task, settings, 5, [1e-3, 1e-3, 5e-4])
    assert state_dict_sha256(policy.model) == expected
    assert calls[1] == replay(tokenizer, task, settings, 5, [1e-3, 1e-3])  # what the snapshot holds


def test_stops_at_the_first_evaluation_in_band(tokenizer, task, scripted, tmp_path):
    settings = tiny_settings(tmp_path, steps=20, target_band=[0.6, 0.8], eval_every=2)
    scripted([0.0, 0.2, 0.6, 0.99])
    policy = make_policy(0)
    out = train_warm_start(policy, tokenizer, task, settings, seed=0, progress_bar=False)
    assert out["steps"] == 4 and out["accuracy"] == 0.6 and out["backoffs"] == 0  # the band is inclusive
    assert state_dict_sha256(policy.model) == replay(tokenizer, task, settings, 0, [settings.lr] * 4)


def test_in_band_before_training_keeps_the_weights(tokenizer, task, scripted, tmp_path):
    scripted([0.7])
    policy = make_policy(0)
    before = state_dict_sha256(policy.model)
    out = train_warm_start(policy, tokenizer, task, tiny_settings(tmp_path, target_band=[0.6, 0.8]), 0, False)
    assert out["steps"] == 0 and out["steps_trained"] == 0 and state_dict_sha256(policy.model) == before


def test_too_many_overshoots_fail_naming_band_history_and_settings(tokenizer, task, scripted, tmp_path):
    settings = tiny_settings(tmp_path, steps=50, target_band=[0.6, 0.7], eval_every=2, max_backoffs=1)
    scripted([0.1, 0.9, 0.95])
    with pytest.raises(WarmStartError) as info:
        train_warm_start(make_policy(0), tokenizer, task, settings, 0, False)
    msg = str(info.value)
    assert "[0.6, 0.7]" in msg and "jumped over" in msg and "2 times" in msg
    assert "step 0: 0.100, step 2: 0.900, step 1: 0.950" in msg
    for knob in ("warmstart.eval_every", "warmstart.lr", "warmstart.max_backoffs", "warmstart.target_band"):
        assert knob in msg


def test_budget_exhausted_fails_naming_band_and_settings(tokenizer, task, scripted, tmp_path):
    settings = tiny_settings(tmp_path, steps=5, target_band=[0.6, 0.7], eval_every=2)
    scripted([0.0, 0.1, 0.2, 0.25])
    with pytest.raises(WarmStartError) as info:
        train_warm_start(make_policy(0), tokenizer, task, settings, 0, False)
    msg = str(info.value)
    assert "[0.6, 0.7]" in msg and "steps=5" in msg and "best greedy accuracy 0.250" in msg
    assert "step 5: 0.250" in msg  # the last segment was cut to the budget: 2 + 2 + 1
    assert "warmstart.steps" in msg and "warmstart.target_band" in msg
    assert [h["step"] for h in info.value.history] == [0, 2, 4, 5]


def test_above_band_before_training_fails(tokenizer, task, scripted, tmp_path):
    scripted([0.9])
    with pytest.raises(WarmStartError, match=r"0\.900 before any SFT, above target_band \[0.6, 0.8\]"):
        train_warm_start(
            make_policy(0), tokenizer, task, tiny_settings(tmp_path, target_band=[0.6, 0.8]), 0, False
        )


def test_without_band_trains_exactly_steps_and_evaluates_once(tokenizer, task, scripted, tmp_path):
    calls = scripted([0.25])
    policy = make_policy(0)
    settings = tiny_settings(tmp_path, steps=3)
    out = train_warm_start(policy, tokenizer, task, settings, 0, False)
    assert len(calls) == 1 and out["steps"] == 3 and out["accuracy"] == 0.25
    assert state_dict_sha256(policy.model) == replay(tokenizer, task, settings, 0, [settings.lr] * 3)


def test_held_out_prompts_are_never_trained_on(tokenizer, task, tmp_path):
    settings = tiny_settings(tmp_path, eval_size=64, batch_size=64)
    data = PromptDataModule(task, val_size=settings.eval_size, batch_size=settings.batch_size, seed=0)
    held_out = {s.prompt for s in data.val_samples()}
    trained = {p for k in range(20) for p in data.train_stream().batch(0, k)["prompt"]}
    assert len(held_out) > 50 and not held_out & trained


class EchoTask(Task):
    """Reward 1 iff the completion is exactly the ``answer`` field (here: a known greedy completion)."""

    def sample(self, rng):  # pragma: no cover - samples are built by hand
        raise NotImplementedError

    def reward(self, prompts, completions, answer=None, **fields):
        return [float(c == a) for c, a in zip(completions, answer)]


def test_greedy_accuracy_matches_hf_generate(tokenizer):
    policy = make_policy(3)
    prompts = ["12+34=", "5+6=", "99+1=", "40+2=", "7+70=", "31+13="]
    samples = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            out = policy.model.generate(
                ids, do_sample=False, max_new_tokens=4, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        completion = tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
        # every other answer is wrong on purpose: the accuracy must be exactly 3/6
        samples.append(TaskSample(prompt, "", {"answer": completion if i % 2 == 0 else completion + "#"}))
    accuracy = GreedyAccuracy(policy, tokenizer, EchoTask(), samples, max_new_tokens=4, batch_size=4)()
    assert accuracy == 0.5
