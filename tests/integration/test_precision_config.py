"""Config-time rules of the fp16 trainer and of the LM head's precision on both sides (ais_lightning.app.build)."""

from __future__ import annotations

import logging

import pytest

from ais_lightning.app.build import validate
from ais_lightning.modules.grpo import same_engine
from tests.integration.test_config import make


@pytest.mark.parametrize(
    "overrides, on",
    [
        (["policy.dtype=bfloat16", "policy.head_dtype=float32"], "policy"),
        (["policy.dtype=bfloat16", "rollout=bf16", "rollout.head_dtype=float32"], "rollout"),
        (["policy.dtype=float16", "rollout=fp16", "rollout.head_dtype=float32"], "rollout"),
        (
            ["policy.dtype=float16", "rollout=fp16", "policy.head_dtype=float32", "rollout.head_dtype=model"],
            "policy",
        ),
    ],
)
def test_a_one_sided_fp32_head_warns_naming_both_keys(overrides, on, caplog):
    with caplog.at_level(logging.WARNING, logger="ais_lightning.app.rules"):
        validate(make(*overrides))
    (message,) = [r.getMessage() for r in caplog.records if r.name == "ais_lightning.app.rules"]
    assert "policy.head_dtype=" in message and "rollout.head_dtype=" in message
    assert f"fp32 on the {on} side only" in message
    off = "rollout" if on == "policy" else "policy"
    assert f"set {off}.head_dtype=float32 as well" in message


@pytest.mark.parametrize(
    "overrides",
    [
        ["policy.dtype=bfloat16", "rollout=bf16", "policy.head_dtype=float32", "rollout.head_dtype=float32"],
        ["policy.dtype=float16", "rollout=fp16", "policy.head_dtype=float32", "rollout.head_dtype=float32"],
        ["policy.dtype=float16", "rollout=fp16"],
        ["rollout=bf16", "rollout.head_dtype=float32"],  # fp32 trainer: the engine's fp32 head only helps
        ["policy.head_dtype=float32"],  # fp32 trainer: a no-op
    ],
)
def test_consistent_heads_validate_without_a_warning(overrides, caplog):
    with caplog.at_level(logging.WARNING, logger="ais_lightning.app.rules"):
        validate(make(*overrides))
    assert not [r for r in caplog.records if r.name == "ais_lightning.app.rules"]


def test_the_trainer_precision_engine_computes_its_head_as_the_policy():
    c = validate(
        make(
            "policy.dtype=float16", "rollout=fp16", "policy.head_dtype=float32", "rollout.head_dtype=float32"
        )
    )
    assert c.engine.keywords["precision"] == "fp16" and c.engine.keywords["head_dtype"] == "float32"
    assert c.eval_engine.keywords["precision"] == "fp32" and c.eval_engine.keywords["head_dtype"] == "float32"


def test_the_default_run_builds_the_engines_it_built_before():
    """The built-in default (fp32 tiny model, int8 rollouts): no fp32 head anywhere, the fp32 engine is a plain
    trainer-precision copy, and the rollout engine differs from it only by precision."""
    c = validate(make())
    assert c.policy.dtype == "float32" and c.policy.head_dtype is None
    assert c.engine.keywords["precision"] == "int8" and c.engine.keywords.get("head_dtype") is None
    assert c.eval_engine.keywords["head_dtype"] is None
    assert same_engine(validate(make("rollout=fp32")).eval_engine, validate(make("rollout=fp32")).engine)


def test_float16_needs_an_unsharded_strategy_and_lightnings_fp32_plugin():
    with pytest.raises(ValueError, match=r"policy\.dtype=float16 .*trainer\.strategy=fsdp2"):
        validate(make("policy.dtype=float16", "rollout=fp16", "trainer=fsdp2"))
    with pytest.raises(ValueError, match=r"policy\.dtype=float16 .*trainer\.precision=16-mixed"):
        validate(make("policy.dtype=float16", "rollout=fp16", "trainer.precision=16-mixed"))


def test_bad_head_dtypes_name_their_key():
    with pytest.raises(ValueError, match="head_dtype must be one of"):
        validate(make("policy.head_dtype=fp32"))
    with pytest.raises(ValueError, match="head_dtype of TorchRolloutEngine must be one of"):
        validate(make("rollout.head_dtype=half"))


def test_the_run_reports_the_int8_kernel_it_runs(int8_isa):
    """The default int8 rollouts: the backend this CPU runs (its MLflow params and its summary's engine line)."""
    from ais_lightning.app.summary import describe_engine
    from ais_lightning.app.tracking import engine_params
    from ais_lightning.models import build_tiny_qwen3
    from ais_lightning.quant.linear import BACKEND_KERNELS

    c = validate(make())
    backend = {"vnni": "int8", "avx2": "fbgemm"}[int8_isa]
    assert engine_params(c.engine) == {
        "engine/precision": "int8",
        "engine/backend": backend,
        "engine/cpu_int8": int8_isa,
    }
    engine = c.engine(build_tiny_qwen3(seed=0))
    assert engine.backend == backend
    assert (
        describe_engine(engine)
        == f"TorchRolloutEngine int8 (backend {backend}: {BACKEND_KERNELS[backend]}; lean forward)"
    )
    assert describe_engine(validate(make("rollout=fp32")).engine(build_tiny_qwen3(seed=0))) == (
        "TorchRolloutEngine fp32 (lean forward)"
    )


def test_int8_rollouts_emulated_for_want_of_an_integer_gemm_are_warned_about(monkeypatch, caplog):
    monkeypatch.setenv(
        "AIS_LIGHTNING_INT8_ISA", "none"
    )  # a CPU without AVX2 (or not x86): no fast integer GEMM
    with caplog.at_level(logging.WARNING, logger="ais_lightning.app.rules"):
        c = validate(make())
        validate(make("rollout.backend=emulate"))  # chosen: no warning
    assert c.engine.checked_arguments["backend"] == "emulate"
    (message,) = [r.getMessage() for r in caplog.records if r.name == "ais_lightning.app.rules"]
    assert "rollout.precision=int8 runs emulated" in message and "int8 kernels: none" in message
