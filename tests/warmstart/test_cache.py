"""warm_start: the cache key, cache hits, corrupt or incomplete entries, threads and RNG left as found."""

import dataclasses
import json
import logging

import pytest
import torch

from ais_lightning.app.warmstart import (
    WarmStartResult,
    cache_key,
    cache_key_payload,
    state_dict_sha256,
    warm_start,
)
from ais_lightning.files import hash_path
from ais_lightning.tasks import get_task
from ais_lightning.tasks.arithmetic import Arithmetic
from tests.warmstart.helpers import make_policy, tiny_settings


def key(tokenizer, task, settings, seed=0, threads=1, policy=None):
    return cache_key(cache_key_payload(policy or make_policy(0), tokenizer, task, settings, seed, threads))


CHANGED = {
    "steps": 3, "batch_size": 5, "lr": 2e-3, "warmup_steps": 4, "weight_decay": 0.1, "grad_clip": 0.5,
    "target_band": [0.1, 0.2], "eval_every": 3, "eval_size": 9, "max_new_tokens": 5, "max_backoffs": 2,
    "backoff_factor": 0.25, "num_threads": 2,
}  # fmt: skip


def test_every_result_setting_is_in_the_key(tokenizer, task, tmp_path):
    base = tiny_settings(tmp_path)
    assert set(CHANGED) == set(base.key_fields())  # a new setting must be added here
    reference = key(tokenizer, task, base)
    for name, value in CHANGED.items():
        assert key(tokenizer, task, dataclasses.replace(base, **{name: value})) != reference, name
    same = dataclasses.replace(base, cache_dir=str(tmp_path / "elsewhere"), enabled=False)
    assert key(tokenizer, task, same) == reference


def test_seed_threads_task_model_and_weights_are_in_the_key(tokenizer, task, tmp_path):
    s = tiny_settings(tmp_path)
    reference = key(tokenizer, task, s)
    assert key(tokenizer, task, s, seed=1) != reference
    assert key(tokenizer, task, s, threads=2) != reference
    assert key(tokenizer, get_task("arithmetic", digits=3, operators="+"), s) != reference

    @dataclasses.dataclass
    class Renamed(Arithmetic):
        pass

    assert key(tokenizer, Renamed(digits=2, operators="+"), s) != reference  # same fields, other class
    assert key(tokenizer, task, s, policy=make_policy(1)) != reference  # other initial weights
    assert key(tokenizer, task, s, policy=make_policy(0, attn_implementation="sdpa")) != reference
    assert key(tokenizer, task, s, policy=make_policy(0)) == reference
    payload = cache_key_payload(make_policy(0), tokenizer, task, s, 0, 1)
    assert payload["torch"] == torch.__version__
    assert payload["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert payload["task"]["fields"] == {**dataclasses.asdict(task)}
    assert payload["model"]["initial_weights_sha256"] == state_dict_sha256(make_policy(0).model)


def test_the_chat_template_is_in_the_key_when_prompts_use_it(tokenizer, task, tmp_path):
    """Prompts in a chat template are other training data: the template joins the key then, and only then
    (raw prompts keep every existing key)."""
    s = tiny_settings(tmp_path)
    reference = key(tokenizer, task, s)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        assert key(tokenizer, task, s) == reference  # a template the prompts do not use changes nothing
        chat = make_policy(0)
        chat.chat_template = True
        with_chat = key(tokenizer, task, s, policy=chat)
        assert with_chat != reference
        tokenizer.chat_template = "{% for m in messages %}> {{ m['content'] }}{% endfor %}"
        assert key(tokenizer, task, s, policy=chat) not in (reference, with_chat)
    finally:
        tokenizer.chat_template = None


def test_task_must_be_a_dataclass_task(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="Task dataclass"):
        cache_key_payload(make_policy(0), tokenizer, "arithmetic", tiny_settings(tmp_path), 0, 1)


def test_settings_type_is_checked(tokenizer, task):
    with pytest.raises(ValueError, match="WarmStartSettings"):
        warm_start(make_policy(0), tokenizer, task, {"steps": 2}, seed=0)


def build(tokenizer, task, settings, seed=0):
    policy = make_policy(0)
    result = warm_start(policy, tokenizer, task, settings, seed=seed, progress_bar=False)
    return policy, result


def test_trained_then_loaded_with_the_same_weights_and_accuracy(tokenizer, task, tmp_path):
    settings = tiny_settings(tmp_path)
    policy, first = build(tokenizer, task, settings)
    assert isinstance(first, WarmStartResult) and not first.from_cache and first.steps == 2
    assert first.path == tmp_path / "cache" / first.key
    assert sorted(p.name for p in first.path.iterdir()) == [
        "meta.json", "meta.json.sha256", "policy.pt", "policy.pt.sha256",
    ]  # fmt: skip
    meta = json.loads((first.path / "meta.json").read_text())
    assert meta["accuracy"] == first.accuracy and meta["payload"]["seed"] == 0
    again, second = build(tokenizer, task, settings)
    assert second.from_cache and second.accuracy == first.accuracy and second.steps == first.steps
    assert second.history == first.history and second.key == first.key
    assert state_dict_sha256(again.model) == state_dict_sha256(policy.model)
    assert "loaded from" in second.describe() and "trained, cached in" in first.describe()
    assert f"{first.accuracy:.3f}" in second.describe()


def test_settings_seed_overrides_the_run_seed(tokenizer, task, tmp_path):
    _, a = build(tokenizer, task, tiny_settings(tmp_path, seed=7), seed=0)
    _, b = build(tokenizer, task, tiny_settings(tmp_path, seed=7), seed=1)
    assert b.from_cache and a.key == b.key


def damage_flip(entry):
    path = entry / "policy.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def damage_truncate(entry):
    path = entry / "policy.pt"
    path.write_bytes(path.read_bytes()[:1000])


def damage_missing_weights(entry):
    (entry / "policy.pt").unlink()


def damage_missing_sidecar(entry):
    hash_path(entry / "policy.pt").unlink()


def damage_meta(entry):
    (entry / "meta.json").write_text("{}")


@pytest.mark.parametrize(
    "damage", [damage_flip, damage_truncate, damage_missing_weights, damage_missing_sidecar, damage_meta]
)
def test_corrupt_or_incomplete_entry_is_named_discarded_and_rebuilt(
    tokenizer, task, tmp_path, caplog, damage
):
    settings = tiny_settings(tmp_path)
    policy, first = build(tokenizer, task, settings)
    reference = state_dict_sha256(policy.model)
    damage(first.path)
    with caplog.at_level(logging.WARNING, logger="ais_lightning.app.warmstart"):
        rebuilt_policy, rebuilt = build(tokenizer, task, settings)
    assert not rebuilt.from_cache  # rebuilt, not loaded
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 1 and str(first.path) in warnings[0] and "discarding and rebuilding" in warnings[0]
    )
    assert state_dict_sha256(rebuilt_policy.model) == reference  # the same deterministic result
    caplog.clear()
    _, third = build(tokenizer, task, settings)  # and the rebuilt entry is valid again
    assert third.from_cache and not caplog.records
    assert not [
        p
        for p in (tmp_path / "cache").iterdir()
        if "discarded" in p.name or p.name.startswith(f".{first.key}-")
    ]


def test_threads_and_rng_are_left_as_found(tokenizer, task, tmp_path):
    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(123)
        expected = torch.rand(3)
        torch.manual_seed(123)
        build(tokenizer, task, tiny_settings(tmp_path, num_threads=1))
        assert torch.get_num_threads() == 2
        assert torch.equal(torch.rand(3), expected)
    finally:
        torch.set_num_threads(before_threads)


def test_wrong_state_dict_in_a_valid_entry_is_rejected(tokenizer, task, tmp_path, caplog):
    from ais_lightning.files import save_verified

    settings = tiny_settings(tmp_path)
    _, first = build(tokenizer, task, settings)
    save_verified({"model.other": torch.zeros(1)}, first.path / "policy.pt")  # valid hash, wrong content
    with caplog.at_level(logging.WARNING, logger="ais_lightning.app.warmstart"):
        _, again = build(tokenizer, task, settings)
    assert not again.from_cache and "does not hold this model's state dict" in caplog.text
