"""WarmStartSettings: defaults, validation naming the field, usable as an OmegaConf schema."""

import dataclasses

import pytest
from omegaconf import OmegaConf

import ais_lightning.app.warmstart.settings as settings_module
from ais_lightning.app.warmstart import WarmStartSettings


def test_defaults_are_valid_and_every_field_is_documented():
    settings = WarmStartSettings()
    assert settings.target_band is None and settings.num_threads == 1 and settings.enabled
    source = open(settings_module.__file__).read()
    for f in dataclasses.fields(WarmStartSettings):  # litgpt style: a docstring right after each field
        assert f"    {f.name}: " in source
        after = source.split(f"    {f.name}: ", 1)[1].split("\n", 2)[1]
        assert after.strip().startswith('"""'), f"field {f.name} has no docstring"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("steps", 0, "steps must be >= 1"),
        ("batch_size", 0, "batch_size must be >= 1"),
        ("eval_every", 0, "eval_every must be >= 1"),
        ("eval_size", 0, "eval_size must be >= 1"),
        ("max_new_tokens", 0, "max_new_tokens must be >= 1"),
        ("warmup_steps", -1, "warmup_steps must be >= 0"),
        ("max_backoffs", -1, "max_backoffs must be >= 0"),
        ("num_threads", -1, "num_threads must be >= 0"),
        ("steps", 2.5, "steps must be an int"),
        ("steps", True, "steps must be an int"),
        ("lr", 0.0, "lr must be > 0"),
        ("lr", float("nan"), "lr must be a finite number"),
        ("weight_decay", -0.1, "weight_decay must be >= 0"),
        ("grad_clip", -1.0, "grad_clip must be >= 0"),
        ("backoff_factor", 1.0, r"backoff_factor must be in \(0, 1\)"),
        ("backoff_factor", 0.0, r"backoff_factor must be in \(0, 1\)"),
        ("target_band", [0.8, 0.7], "low <= high"),
        ("target_band", [-0.1, 0.5], "0 <= low"),
        ("target_band", [0.5, 1.5], "high <= 1"),
        ("target_band", [0.5], r"\[low, high\]"),
        ("target_band", ["a", "b"], r"\[low, high\]"),
        ("seed", "1", "seed must be an int"),
    ],
)
def test_bad_values_raise_naming_the_field(field, value, message):
    with pytest.raises(
        ValueError, match=rf"WarmStartSettings\.{field} .*{message}|WarmStartSettings\.{message}"
    ):
        WarmStartSettings(**{field: value})


def test_band_from_a_config_becomes_a_float_list():
    settings = WarmStartSettings(target_band=OmegaConf.create([0, 1]), lr=1)
    assert settings.target_band == [0.0, 1.0] and type(settings.target_band) is list
    assert isinstance(settings.lr, float)
    assert WarmStartSettings(target_band=(0.7, 0.7)).target_band == [0.7, 0.7]  # a point band is allowed


def test_is_an_omegaconf_schema():
    schema = OmegaConf.structured(WarmStartSettings)
    merged = OmegaConf.merge(schema, {"target_band": [0.65, 0.75], "lr": 5e-4, "seed": 1})
    settings = WarmStartSettings(**OmegaConf.to_container(merged))
    assert settings.target_band == [0.65, 0.75] and settings.lr == 5e-4 and settings.seed == 1
    with pytest.raises(Exception, match="steps"):
        OmegaConf.merge(schema, {"steps": "many"})
    with pytest.raises(Exception, match="stesp"):
        OmegaConf.merge(schema, {"stesp": 3})


def test_key_fields_leave_out_what_does_not_change_the_result():
    fields = WarmStartSettings(cache_dir="/x", enabled=False, seed=3).key_fields()
    assert "cache_dir" not in fields and "enabled" not in fields and "seed" not in fields
    every = {f.name for f in dataclasses.fields(WarmStartSettings)}
    assert set(fields) == every - {"cache_dir", "enabled", "seed"}
