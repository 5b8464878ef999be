"""Structured configs: the schema that Hydra checks before anything heavy starts.

Every group of ``conf/`` (policy, rollout, corrector, task, algorithm, trainer, logger, warmstart)
has one dataclass here. They are registered in Hydra's ConfigStore as ``<group>/schema`` and each
YAML option lists its schema first in its defaults, so a typo in a key (``corrector.c_hihg=3``) or a
wrong type (``algorithm.group_size=abc``) fails at composition time with the key named. Cross-field
checks that a type cannot express live in ``validate`` (called by ``ais-train`` right after
composition, before the model is built).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class PolicyConfig:
    """The trainer's policy (a Hugging Face causal LM)."""

    name: str = "tiny_qwen3"
    """"tiny_qwen3" builds the built-in model (no hub); anything else is a local HF model directory."""
    path: str | None = None
    """Local directory of a Hugging Face causal LM (used when name is not "tiny_qwen3")."""
    dtype: str = "float32"
    """Trainer precision: float32 (the CPU default: bf16 is 5x slower here) or bfloat16."""
    logprob_chunk_size: int = 1024
    """Positions per chunk when computing log-probs/entropy, bounding the [B, T, V] logits memory."""
    aligned_quantization: str | None = None
    """QaRL: run the trainer forward through this ``ais_lightning.quant`` recipe (straight-through
    gradients, fp32 master weights); "rollout" = the recipe of the rollout precision; None = off."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Qwen3Config overrides for the tiny model (e.g. {num_hidden_layers: 2})."""


@dataclass
class RolloutConfig:
    """The rollout engine that generates with its own (low-precision) forward."""

    engine: str = "torch"
    """torch | vllm | te."""
    precision: str = "int8"
    """fp32 | bf16 | fp8 | fp4 | int8 (which ones an engine supports is checked at start)."""
    kv_cache_dtype: str | None = None
    """None (same as the weights) or "fp8" (FP8 E4M3 KV cache, scales recalibrated after each sync)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the engine (e.g. gpu_memory_utilization for vLLM)."""


@dataclass
class CorrectorConfig:
    """The importance-sampling corrector; ``name`` picks which of the fields apply."""

    name: str = "ais"
    """none | tis | mis | ais | qarl (rollout-aligned forward + TBPO, arXiv 2604.07853)."""
    level: str = "token"
    """TIS/MIS ratio level: token | sequence | geometric."""
    c_high: float = 2.0
    """TIS clip / MIS upper bound."""
    c_low: float | None = None
    """TIS lower clip (None = no lower clip) / MIS lower bound (None = 1/c_high... see MIS)."""
    veto: float | None = None
    """MIS: reject a whole sequence with any token ratio below this."""
    c: float = 2.0
    """AIS truncation C."""
    kappa: float = 1.0
    """AIS severity scale: s = 1 - exp(-D / (kappa * (H + eps)))."""
    alpha: float = 1.0
    """AIS exponent on the weight reliability R."""
    beta: float = 1.0
    """AIS exponent on the variance factor v."""
    lambda_min: float = 0.0
    """AIS lower clamp on lambda."""
    lambda_max: float = 1.0
    """AIS upper clamp on lambda."""
    use_reliability: bool = True
    """AIS ablation switch for R."""
    use_severity: bool = True
    """AIS ablation switch for s."""
    use_variance: bool = True
    """AIS ablation switch for v."""
    ema_decay: float | None = None
    """AIS: EMA of lambda across steps (None = off)."""
    fixed_lambda: float | None = None
    """AIS: force lambda (ablation)."""
    band_low: float = 0.5
    """QaRL/TBPO: sequences whose geometric-mean mismatch pi_old/mu is below this are dropped."""
    band_high: float = 2.0
    """QaRL/TBPO: ... or above this."""
    tbpo_epsilon_low: float = 3e-4
    """QaRL/TBPO: clip below 1 of the sequence-level (geometric-mean) ratio."""
    tbpo_epsilon_high: float = 4e-4
    """QaRL/TBPO: clip above 1 of the sequence-level ratio."""
    tbpo_dual_clip: float | None = 3.0
    """QaRL/TBPO: dual-clip bound for negative advantages (None = off)."""


@dataclass
class TaskConfig:
    """The RL task: prompts, rewards and the DataModule."""

    name: str = "arithmetic"
    """A registered task: arithmetic | countdown | sudoku4 | gsm8k | a user's own."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task's constructor (e.g. {digits: 2})."""
    val_size: int = 128
    """Held-out prompts for validation accuracy."""


@dataclass
class AlgorithmConfig:
    """GRPO: sampling, advantages, the clipped surrogate and the optimizer."""

    prompts_per_step: int = 16
    """Prompts per rollout step (per rank)."""
    group_size: int = 8
    """Responses per prompt (GRPO group)."""
    max_new_tokens: int = 8
    """Response length bound."""
    temperature: float = 1.0
    """Sampling temperature (trainer log-probs use the same)."""
    top_p: float = 1.0
    """Nucleus sampling; keep 1.0 with a corrector on (it changes mu)."""
    top_k: int = 0
    """Top-k sampling; keep 0 with a corrector on."""
    advantage_scale: str = "group"
    """group | batch | none (Dr. GRPO)."""
    epsilon_low: float = 0.2
    """PPO clip below 1."""
    epsilon_high: float = 0.28
    """PPO clip above 1 (DAPO's clip-higher)."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 for negative advantages (None = off)."""
    kl_coef: float = 0.0
    """k3 KL penalty to the initial policy (0 = off, no reference model kept)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    aggregation: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum-norm."""
    mode: str = "decoupled"
    """decoupled (ratio vs the trainer's pi_old, IS weight pi_old/mu) | bypass (pi_old := mu)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per pass (the rollout batch is split into this many mini-batches)."""
    lr: float = 3e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max gradient norm (0 = off)."""
    val_every_n_steps: int = 50
    """Validation period in training steps."""


@dataclass
class WarmStartConfig:
    """Supervised warm-start of the policy on the task's reference solutions, cached on disk."""

    enabled: bool = True
    """Run (or load from cache) the warm-start before RL."""
    steps: int = 500
    """SFT optimizer steps."""
    batch_size: int = 128
    """SFT batch size."""
    lr: float = 3e-3
    """SFT AdamW learning rate."""
    seed: int | None = None
    """SFT seed; null = the run's ``seed``. Fix it to start every RL seed from one checkpoint."""
    cache_dir: str | None = None
    """Where warm-started models are cached (default ~/.cache/ais_lightning/warmstart)."""


@dataclass
class TrainerConfig:
    """Lightning Trainer settings."""

    max_steps: int = 200
    """Training (rollout) steps."""
    accelerator: str = "cpu"
    """cpu | gpu | auto."""
    devices: Any = 1
    """Devices (processes) to use."""
    strategy: str = "auto"
    """auto | fsdp2 (ModelParallelStrategy, FSDP2 fully_shard; runs on CPU) | fsdp (FSDPStrategy, CUDA only)."""
    precision: str = "32-true"
    """Lightning precision plugin (the trainer's precision)."""
    checkpoint_every_n_steps: int = 0
    """Save a checkpoint every N steps (0 = only at the end)."""
    enable_progress_bar: bool = True
    """Show a progress bar."""
    num_threads: int | None = None
    """torch intra-op threads (None = torch's default)."""


@dataclass
class LoggerConfig:
    """Experiment tracking."""

    name: str = "mlflow"
    """mlflow | csv | none."""
    experiment_name: str = "ais_lightning"
    """MLflow experiment."""
    run_name: str | None = None
    """MLflow run name (default: derived from the overrides)."""
    tracking_uri: str | None = None
    """MLflow tracking URI; None = $MLFLOW_TRACKING_URI, else a SQLite store under the output directory."""


@dataclass
class TrainConfig:
    """The whole run (``conf/train.yaml``)."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    corrector: CorrectorConfig = field(default_factory=CorrectorConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    """Seed of everything: data, sampling, model init."""
    ckpt_path: str | None = None
    """Resume from this Lightning checkpoint ("last" = the newest in the output directory)."""
    output_dir: str = MISSING
    """Where checkpoints, the summary and the default MLflow store go (Hydra's run directory)."""


_GROUPS = {
    "policy": PolicyConfig,
    "rollout": RolloutConfig,
    "corrector": CorrectorConfig,
    "task": TaskConfig,
    "algorithm": AlgorithmConfig,
    "warmstart": WarmStartConfig,
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
}


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, node in _GROUPS.items():
        cs.store(group=group, name="schema", node=node)


def _choice(value: Any, allowed: tuple[str, ...], key: str) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {list(allowed)}")


def validate(cfg: Any) -> None:
    """Cross-field checks on a composed TrainConfig; raises ValueError naming the key.

    Types and unknown keys are already checked by the schema; this adds the rules a type
    cannot express. It builds nothing heavy (no model, no engine).
    """
    from ais_lightning.rollout.factory import ENGINES, engine_precisions

    _choice(cfg.rollout.engine, ENGINES, "rollout.engine")
    _choice(cfg.rollout.precision, engine_precisions(cfg.rollout.engine), "rollout.precision")
    if cfg.rollout.kv_cache_dtype not in (None, "fp8", "auto"):
        raise ValueError(f"rollout.kv_cache_dtype={cfg.rollout.kv_cache_dtype!r} is not one of [null, 'fp8']")
    from ais_lightning.correctors import CORRECTORS, LEVELS

    _choice(cfg.corrector.name, (*CORRECTORS, "qarl"), "corrector.name")
    _choice(cfg.corrector.level, tuple(LEVELS), "corrector.level")
    _choice(cfg.algorithm.advantage_scale, ("group", "batch", "none"), "algorithm.advantage_scale")
    _choice(
        cfg.algorithm.aggregation,
        ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        "algorithm.aggregation",
    )
    _choice(cfg.algorithm.mode, ("decoupled", "bypass"), "algorithm.mode")
    _choice(cfg.trainer.strategy, ("auto", "fsdp2", "fsdp"), "trainer.strategy")
    _choice(cfg.logger.name, ("mlflow", "csv", "none"), "logger.name")
    _choice(cfg.policy.dtype, ("float32", "bfloat16"), "policy.dtype")
    positive = {
        "algorithm.prompts_per_step": cfg.algorithm.prompts_per_step,
        "algorithm.group_size": cfg.algorithm.group_size,
        "algorithm.max_new_tokens": cfg.algorithm.max_new_tokens,
        "algorithm.ppo_epochs": cfg.algorithm.ppo_epochs,
        "algorithm.mini_batches": cfg.algorithm.mini_batches,
        "algorithm.val_every_n_steps": cfg.algorithm.val_every_n_steps,
        "trainer.max_steps": cfg.trainer.max_steps,
        "task.val_size": cfg.task.val_size,
        "policy.logprob_chunk_size": cfg.policy.logprob_chunk_size,
    }
    for key, value in positive.items():
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")
    if cfg.algorithm.lr <= 0:
        raise ValueError(f"algorithm.lr must be > 0, got {cfg.algorithm.lr}")
    if cfg.algorithm.temperature <= 0:
        raise ValueError(
            f"algorithm.temperature must be > 0 for RL (log-probs at T=0 are undefined), got {cfg.algorithm.temperature}"
        )
    n_rows = cfg.algorithm.prompts_per_step * cfg.algorithm.group_size
    if n_rows % cfg.algorithm.mini_batches != 0:
        raise ValueError(
            f"algorithm.mini_batches={cfg.algorithm.mini_batches} must divide prompts_per_step * group_size = {n_rows}"
        )
    if cfg.algorithm.mode == "bypass" and cfg.corrector.name != "none":
        raise ValueError(
            "algorithm.mode=bypass uses pi_old := mu and has no separate IS weight: set corrector=none "
            f"(got corrector.name={cfg.corrector.name!r})"
        )
    if cfg.corrector.name != "none" and (cfg.algorithm.top_p < 1.0 or cfg.algorithm.top_k > 0):
        raise ValueError(
            "algorithm.top_p/top_k renormalize mu over the kept tokens; with a corrector on keep top_p=1.0 and top_k=0"
        )
    if cfg.corrector.name == "qarl" and cfg.policy.aligned_quantization is None:
        raise ValueError(
            "corrector.name=qarl needs policy.aligned_quantization (use corrector=qarl, which sets it)"
        )
    aligned = cfg.policy.aligned_quantization
    if aligned == "rollout" and cfg.rollout.precision not in ("fp8", "fp4", "int8"):
        raise ValueError(
            f"policy.aligned_quantization=rollout needs a quantized rollout.precision (fp8/fp4/int8), "
            f"got {cfg.rollout.precision!r}"
        )
    if aligned is not None and cfg.trainer.strategy != "auto":
        raise ValueError(
            "policy.aligned_quantization is not supported with sharded strategies yet (trainer.strategy)"
        )
    if cfg.policy.name != "tiny_qwen3" and not cfg.policy.path:
        raise ValueError(
            f"policy.path must name a local model directory when policy.name={cfg.policy.name!r}"
        )
