"""Every config option composes against its schema, validates, and builds its cheap components."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from ais_lightning.app.build import validate
from ais_lightning.app.config import CONFIG_DIR, register_configs

register_configs()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def make(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=["output_dir=/tmp/ais-test-unused", *overrides])


def test_configs_ship_inside_the_package():
    assert (CONFIG_DIR / "train.yaml").exists()
    assert {
        "policy",
        "rollout",
        "corrector",
        "task",
        "algorithm",
        "trainer",
        "logger",
        "experiment",
        "sweep",
    } <= {p.name for p in CONFIG_DIR.iterdir() if p.is_dir()}


@pytest.mark.parametrize("name", options("corrector"))
def test_every_corrector_option_builds(name):
    c = validate(make(f"corrector={name}"))
    expected = {"qarl": "NoCorrection"}
    for option, cls in __import__("ais_lightning.correctors").correctors.CORRECTORS.items():
        expected.setdefault(option, cls.__name__)
    assert type(c.corrector).__name__ == expected.get(name, type(c.corrector).__name__)
    assert type(c.loss).__name__ == ("TBPOLoss" if name == "qarl" else "GRPOLoss")


def test_ais_reads_beta1_and_the_steps_per_batch_from_the_trainer():
    # AIS v2 scores the update AdamW applies: its first moment averages the noise by (1 - b1) / (1 + b1)
    import inspect

    import torch

    from ais_lightning.correctors.ais import averaged_noise_factor

    torch_beta1 = inspect.signature(torch.optim.AdamW).parameters["betas"].default[0]
    components = validate(make("corrector=ais"))
    assert components.corrector.params.momentum == torch_beta1 == components.algorithm.betas[0] == 0.9
    assert components.corrector.params.update_noise_to_signal == pytest.approx(1 / 19, rel=1e-15)
    # one source: the optimizer's beta1 moves the corrector's with it; an explicit override still wins
    moved = validate(make("corrector=ais", "algorithm.betas=[0.5,0.999]"))
    assert moved.corrector.params.momentum == 0.5 and moved.algorithm.betas == (0.5, 0.999)
    assert moved.corrector.params.update_noise_to_signal == pytest.approx(averaged_noise_factor(0.5))
    assert validate(make("corrector=ais", "corrector.momentum=0.0")).corrector.params.momentum == 0.0
    one_step = validate(make("corrector=ais_one_step")).corrector.params
    assert one_step.momentum == 0.0 and one_step.update_noise_to_signal == 1.0
    # and its steps per rollout batch: epochs reuse the batch, mini-batches split it (averaged_noise_factor)
    split = validate(
        make("corrector=ais", "algorithm.ppo_epochs=2", "algorithm.mini_batches=4")
    ).corrector.params
    assert (split.ppo_epochs, split.mini_batches) == (2, 4)
    assert split.update_noise_to_signal == pytest.approx(averaged_noise_factor(0.9, 2, 4), rel=1e-15)
    assert split.update_noise_to_signal > 4 / 19  # reuse correlates the averaged noise
    one_split = validate(make("corrector=ais_one_step", "algorithm.mini_batches=4")).corrector.params
    assert one_split.update_noise_to_signal == pytest.approx(4.0)  # one quarter-batch step


@pytest.mark.parametrize("bad", ["[0.9]", "[1.0,0.999]", "[-0.1,0.999]"])
def test_bad_adam_betas_name_the_field(bad):
    with pytest.raises(Exception, match="betas"):
        validate(make(f"algorithm.betas={bad}"))


@pytest.mark.parametrize("name", [n for n in options("task") if n != "gsm8k"])
def test_every_task_option_builds(name):
    task = validate(make(f"task={name}")).task
    assert task.sample(__import__("random").Random(0)).prompt


@pytest.mark.parametrize(
    "group", ["rollout", "loss", "algorithm", "trainer", "logger", "warmstart", "policy", "experiment"]
)
def test_every_option_of_the_remaining_groups_composes(group):
    for name in options(group):
        if group == "rollout" and name.startswith(("vllm", "te", "fp8_gemm")):
            continue  # needs vLLM / Transformer Engine / CUDA: tests/rollout and tests/gpu check the error
        if group == "policy" and name in ("local", "gguf"):
            with pytest.raises(ValueError, match="policy.path"):
                validate(make(f"policy={name}"))
            continue
        extra = ["corrector=none"] if (group, name) in (("loss", "bypass"), ("loss", "tbpo")) else []
        if (group, name) == ("trainer", "fsdp_gpu"):
            extra = ["rollout=bf16"]  # the default int8 engine (integer GEMM) runs on CPU only
        if (group == "rollout" and name.startswith("llada")) or (group, name) == ("policy", "tiny_llada"):
            extra = ["policy=tiny_llada", "rollout=llada_fp32", f"{group}={name}"]  # one model family
        validate(make(f"{group}={name}", *extra))


def test_an_option_yaml_restates_no_constructor_default():
    """Every default lives in its constructor: an option YAML sets only what makes it that option."""
    import yaml

    from ais_lightning.app.config import builtin_options, schema_for

    registry = builtin_options()
    for path in CONFIG_DIR.glob("*/*.yaml"):
        data = yaml.safe_load(path.read_text()) or {}
        bases = [d for d in data.get("defaults", []) if isinstance(d, str) and d.startswith("/schema/")]
        if not bases or not bases[0].endswith("@_here_"):
            continue
        group, name = bases[0].removeprefix("/schema/").split("@")[0].split("/")
        defaults = schema_for(registry[group][name])()
        for key, value in data.items():
            if key == "defaults" or getattr(defaults, key, object()) != value:
                continue
            # An option named after a value states it (rollout=fp32 says precision: fp32) so that it keeps
            # meaning what its name says if the constructor's default changes; anything else is a copy.
            if str(value) not in path.stem:
                raise AssertionError(f"{path.relative_to(CONFIG_DIR)} restates the default {key}={value!r}")


def test_typo_in_a_key_fails_at_composition_naming_it():
    with pytest.raises(ConfigCompositionException, match="corrector.c_hihg"):
        make("corrector.c_hihg=3")


def test_wrong_type_fails_at_composition_naming_the_key():
    with pytest.raises(ConfigCompositionException, match="algorithm.group_size"):
        make("algorithm.group_size=abc")


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.precision=fp6", "rollout.precision"),
        ("corrector._target_=foo.Bar", "corrector._target_"),
        ("loss.aggregation=mean", "loss.aggregation"),
        ("algorithm.mini_batches=3", "algorithm.mini_batches"),
        ("algorithm.temperature=0", "algorithm.temperature"),
        ("algorithm.min_p=1.5", "algorithm.min_p"),
        ("loss.mode=bypass", "loss.mode=bypass"),
        ("trainer.max_steps=0", "trainer.max_steps"),
    ],
)
def test_contradictory_values_fail_validation_naming_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate(make(override))


def test_truncated_sampling_with_a_corrector_is_replayed_and_refused_only_where_it_cannot_be(monkeypatch):
    """top-p / top-k / min-p with a corrector: allowed when the engine records the kept sets and the policy replays
    them (the default); refused with replay off, or with an engine that cannot record them (named, with why)."""
    c = validate(make("algorithm.top_p=0.9", "algorithm.top_k=20", "corrector=ais"))
    assert c.algorithm.replay_support and c.engine.engine_class.support_replay_gap(20, 0.9, 0.0) is None
    validate(make("algorithm.min_p=0.1", "rollout=llada_fp4", "policy=tiny_llada", "experiment=llada_small"))
    with pytest.raises(ValueError, match="algorithm.replay_support=false"):
        validate(make("algorithm.top_p=0.9", "algorithm.replay_support=false"))
    validate(make("algorithm.top_p=0.9", "algorithm.replay_support=false", "corrector=none"))
    from ais_lightning.rollout import engine_args

    monkeypatch.setattr(engine_args, "has_package", lambda name: True)  # vLLM's config checks, without vLLM
    with pytest.raises(ValueError, match=r"rollout._target_=\S*VLLMRolloutEngine cannot record them: vLLM"):
        validate(make("rollout=vllm_cpu", "algorithm.top_p=0.9"))
    validate(make("rollout=vllm_cpu", "algorithm.top_p=0.9", "algorithm.top_k=20"))
    validate(make("rollout=vllm_cpu", "algorithm.top_p=0.9", "corrector=none"))


def test_a_run_has_one_clip_bound_the_correctors():
    """corrector.c=4: the diagnostics GRPOModule builds from the corrector count ratios beyond 4 and compute AIS's
    lambda with the corrector's own parameters (tests/modules/test_grpo_module.py checks the logged values)."""
    from ais_lightning.diagnostics import MismatchDiagnostics

    corrector = validate(make("corrector=ais", "corrector.c=4")).corrector
    metrics = MismatchDiagnostics(params=corrector.diagnostic_params())
    assert metrics["ratio_frac_above"].c == 4.0 and metrics["ais_lambda"].params == corrector.params
    assert validate(make("corrector=tis", "corrector.c_high=3")).corrector.diagnostic_params().c == 3.0


def test_a_policy_and_an_engine_of_different_model_families_are_refused():
    with pytest.raises(ValueError, match="masked_diffusion"):
        validate(make("policy=tiny_llada"))  # with the autoregressive default rollout=int8
    with pytest.raises(ValueError, match="response_length"):
        validate(make("policy=tiny_llada", "rollout=llada_fp4", "policy.response_length=5"))


def test_the_diffusion_preset_warm_starts_on_its_canvas_length():
    c = validate(make("experiment=llada_small"))
    assert type(c.policy).__name__ == "TinyLLaDA" and c.warmstart.max_new_tokens == c.policy.response_length
    with pytest.raises(ValueError, match="warmstart.max_new_tokens=5 must equal policy.response_length=8"):
        validate(make("experiment=llada_small", "warmstart.max_new_tokens=5"))


@pytest.mark.parametrize("preset", options("experiment"))
def test_every_experiment_preset_composes_and_validates(preset):
    validate(make(f"experiment={preset}"))


def test_the_sudoku_preset_fits_a_whole_grid_in_its_responses():
    c = validate(make("experiment=paper_sudoku4"))
    assert type(c.task).__name__ == "Sudoku4" and c.task.empty_cells == 8
    assert c.algorithm.max_new_tokens == 17 and c.warmstart.max_new_tokens == 17  # 16 digits + end
    assert c.warmstart.target_band == [0.65, 0.75]


def test_the_long_sudoku_preset_is_the_sudoku_preset_trained_longer():
    """Same warm start (the same warmstart and task settings), 600 steps, its own MLflow experiment."""
    short, long = make("experiment=paper_sudoku4"), make("experiment=paper_sudoku4_long")
    assert long.trainer.max_steps == 600 and long.logger.experiment_name == "paper_sudoku4_long"
    assert long.warmstart == short.warmstart and long.task == short.task and long.algorithm == short.algorithm


def test_qarl_sets_the_aligned_forward_and_needs_a_quantized_rollout():
    cfg = make("corrector=qarl", "rollout=fp8")
    assert cfg.policy.aligned_quantization == "fp8"
    c = validate(cfg)
    assert c.policy.aligned_quantization == "fp8" and type(c.loss).__name__ == "TBPOLoss"
    with pytest.raises(ValueError, match="aligned_quantization"):
        validate(make("corrector=qarl", "rollout=fp32"))


def test_qarl_says_in_the_composed_config_what_it_sets():
    """``corrector=qarl`` sets keys of other groups; ``--cfg job`` shows them under ``shortcuts``."""
    assert dict(make().shortcuts) == {}
    said = make("corrector=qarl", "rollout=fp4").shortcuts.qarl
    assert "loss=tbpo" in said and "corrector=none" in said and "policy.aligned_quantization=fp4" in said


def test_an_aligned_forward_keeps_no_outlier_channel_in_the_engine():
    """The aligned trainer quantizes every input channel, so the engine's default outlier channels go to 0."""
    assert validate(make("rollout=fp8")).engine.keywords.get("outlier_fraction") is None  # 0.05 when built
    assert validate(make("corrector=qarl", "rollout=fp8")).engine.keywords["outlier_fraction"] == 0.0
    with pytest.raises(ValueError, match="rollout.outlier_fraction=0.05 keeps outlier channels"):
        validate(make("corrector=qarl", "rollout=fp8", "rollout.outlier_fraction=0.05"))


def test_bypass_mode_with_no_corrector_is_valid():
    validate(make("loss=bypass", "corrector=none"))


def test_sweep_preset_lists_the_four_correctors():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["output_dir=/x", "sweep=correctors"], return_hydra_config=True)
    assert cfg.hydra.sweeper.params.corrector == "none,tis,mis,ais"


def test_console_script_finds_the_packaged_configs():
    """``ais-train`` (the console script) composes from the configs inside the installed package."""
    import shutil
    import subprocess
    import sys

    script = Path(sys.executable).with_name("ais-train")
    exe = str(script) if script.exists() else shutil.which("ais-train")
    assert exe, "ais-train is not installed"
    proc = subprocess.run(
        [exe, "--cfg", "job", "corrector=tis_geo"], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr
    assert "level: geometric" in proc.stdout
    help_text = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=300, cwd="/").stdout
    assert help_text.startswith("ais-train: GRPO on low-precision rollouts")
    corrector_line = next(line for line in help_text.splitlines() if line.startswith("corrector:"))
    assert set(options("corrector")) <= {o.strip() for o in corrector_line.split(":")[1].split(",")}


def test_fsdp_gpu_strategy_fails_clearly_without_cuda():
    import torch

    trainer = validate(make("trainer=fsdp_gpu", "rollout=bf16")).trainer
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the strategy builds (covered by the GPU test)")
    with pytest.raises(ValueError, match="trainer.strategy=fsdp"):
        trainer.strategy_object()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_fsdp_gpu_strategy_builds_on_cuda():
    from lightning.pytorch.strategies import ModelParallelStrategy

    assert isinstance(
        validate(make("trainer=fsdp_gpu", "rollout=bf16")).trainer.strategy_object(), ModelParallelStrategy
    )


@pytest.mark.parametrize("preset", ["correctors", "correctors_all", "paper_small"])
def test_sweep_presets_name_existing_options(preset):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["output_dir=/x", f"sweep={preset}"], return_hydra_config=True)
    for group, values in cfg.hydra.sweeper.params.items():
        if group in ("corrector", "rollout"):
            assert set(str(values).split(",")) <= set(options(group)), (preset, group)


def test_every_example_of_the_help_composes_and_validates():
    import yaml

    header = yaml.safe_load((CONFIG_DIR / "train.yaml").read_text())["hydra"]["help"]["header"]
    commands = [
        line.split("   ")[0].split()[1:] for line in header.splitlines() if line.startswith("  ais-train")
    ]
    assert len(commands) >= 8  # the command, then its description after three spaces or more
    overrides = [c for c in commands if all("=" in a and not a.startswith("-") for a in c)]
    assert [] in overrides and ["algorithm.max_staleness=2"] in overrides and ["workers=ray"] in overrides
    for args in overrides:
        if args == ["ckpt_path=PATH"]:
            continue
        validate(
            make(*args)
        )  # the option exists and the config it makes passes the checks that run before training
