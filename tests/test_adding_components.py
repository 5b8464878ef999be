"""docs/design.md, "Adding a corrector / an engine / a task / a policy": the three steps (the class, its name in
the registry, its YAML option) taken with a toy of each kind, each step checked; then one run trains with the
four toys."""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException

from ais_lightning.app.build import validate
from ais_lightning.app.config import compose_train_config
from ais_lightning.correctors import CORRECTORS, CorrectionOutput, Corrector, RawCorrection, build_corrector
from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.policy import POLICIES, Policy, PolicySpec
from ais_lightning.rollout import ENGINES, RolloutBatch, RolloutEngine, SamplingConfig, build_engine
from ais_lightning.rollout.prompts import left_pad
from ais_lightning.tasks import TASKS, Task, TaskSample, first_line, get_task

# ------------------------------------------------------------------------------- step 1: four toy classes


class ScaledWeights(Corrector):
    """Every valid token weighs ``scale`` (reported as ``toy/scale``)."""

    def __init__(self, scale: float = 0.5) -> None:
        super().__init__()
        if not 0 < scale <= 1:
            raise ValueError(f"scale must be in (0, 1], got {scale}")
        self.scale = float(scale)

    def correct(self, delta, mask, advantages, entropy) -> RawCorrection:
        weights = torch.full_like(delta, self.scale)  # [B, T]
        return RawCorrection(weights, mask, torch.zeros_like(mask), {"toy/scale": torch.tensor(self.scale)})


class UniformSampler(RolloutEngine):
    """Samples every response token uniformly from the first ``vocab`` token ids, whatever the weights:
    mu = 1 / vocab, so every log-prob is -log(vocab)."""

    PRECISIONS: ClassVar[tuple[str, ...]] = ("fp32",)
    syncs: ClassVar[list[int]] = []
    """Tensors of every weight sync of every instance (read by the end-to-end test)."""

    def __init__(self, model: torch.nn.Module, precision: str = "fp32", vocab: int = 20) -> None:
        self.precision, self.vocab = self.check_args(precision=precision, vocab=vocab).values()
        self.pad = model.config.pad_token_id or 0

    @classmethod
    def check_args(cls, **kwargs: Any) -> dict[str, Any]:
        unknown = set(kwargs) - {"precision", "vocab"}
        if unknown:
            raise ValueError(f"unknown argument {sorted(unknown)}; UniformSampler accepts precision, vocab")
        args = {"precision": "fp32", "vocab": 20, **kwargs}
        if args["precision"] not in cls.PRECISIONS:
            raise ValueError(f"precision must be one of {list(cls.PRECISIONS)}, got {args['precision']!r}")
        if not (isinstance(args["vocab"], int) and args["vocab"] >= 2):
            raise ValueError(f"vocab must be an int >= 2, got {args['vocab']!r}")
        return args

    def sync_weights(self, named_tensors) -> None:
        UniformSampler.syncs.append(len(list(named_tensors)))

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        rows = [p for p in prompts for _ in range(sampling.n)]
        generator = torch.Generator().manual_seed(0 if sampling.seed is None else sampling.seed)
        shape = (len(rows), sampling.max_new_tokens)
        prompt_ids, prompt_mask = left_pad(rows, self.pad)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=torch.randint(self.vocab, shape, generator=generator),  # [B, T]
            response_mask=torch.ones(shape, dtype=torch.bool),
            rollout_logprobs=torch.full(shape, -math.log(self.vocab)),  # [B, T]
            finish_reason=["length"] * len(rows),
            prompt_index=torch.arange(len(prompts)).repeat_interleave(sampling.n),
        )


@dataclass
class Reverse(Task):
    """Prompt a word of ``length`` letters and ``>``; reward 1 for the word reversed on the first line."""

    name: ClassVar[str] = "reverse"
    length: int = 3
    """Letters per word."""

    def __post_init__(self) -> None:
        if not (isinstance(self.length, int) and self.length >= 1):
            raise ValueError(f"length must be an int >= 1, got {self.length!r}")

    def sample(self, rng: random.Random) -> TaskSample:
        word = "".join(rng.choice("abc") for _ in range(self.length))
        return TaskSample(word + ">", word[::-1], {"answer": word[::-1]})

    def reward(self, prompts, completions, answer=None, **fields) -> list[float]:
        return [float(first_line(c) == a) for c, a in zip(completions, answer)]


@dataclass
class OneLayerQwen3(PolicySpec):
    """The built-in tiny Qwen3 cut to ``layers`` decoder layers, with the character tokenizer."""

    layers: int = 1
    """Decoder layers."""
    built: ClassVar[list[int]] = []
    """Layers of every policy built (read by the end-to-end test)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.layers, int) and 1 <= self.layers <= 4):
            raise ValueError(f"layers must be an int in [1, 4], got {self.layers!r}")

    def build(self, seed: int = 0) -> Policy:
        model = build_tiny_qwen3(seed=seed, num_hidden_layers=self.layers)
        OneLayerQwen3.built.append(model.config.num_hidden_layers)
        return Policy(model, build_char_tokenizer())


TOYS = {
    "corrector": (CORRECTORS, ScaledWeights, "scale: 0.25\n"),
    "rollout": (ENGINES, UniformSampler, "vocab: 12\n"),
    "task": (TASKS, Reverse, "length: 2\n"),
    "policy": (POLICIES, OneLayerQwen3, "layers: 1\n"),
}
"""Group -> (the registry, the toy, its option's values)."""


def test_step_1_each_toy_keeps_the_contract_of_its_base():
    mask = torch.tensor([[True, True, False]])
    out = ScaledWeights(0.25)(torch.zeros(1, 3), torch.zeros(1, 3), mask)
    assert isinstance(out, CorrectionOutput) and out.weights.tolist() == [[0.25, 0.25, 0.0]]
    assert out.stats["toy/scale"] == 0.25 and out.mask.tolist() == mask.tolist()
    with pytest.raises(ValueError, match="^scale must be"):
        ScaledWeights(0)

    policy = OneLayerQwen3().build(seed=0)
    assert isinstance(policy, Policy) and policy.model.config.num_hidden_layers == 1
    engine = UniformSampler(policy.model, vocab=12)
    batch = engine.generate([[5, 6, 7], [8]], SamplingConfig(n=2, max_new_tokens=4, seed=1))
    assert batch.response_ids.shape == (4, 4) and int(batch.response_ids.max()) < 12
    assert batch.prompt_index.tolist() == [0, 0, 1, 1] and batch.prompt_mask.sum(1).tolist() == [3, 3, 1, 1]
    scored = policy.batch_logprobs(batch, temperature=1.0)  # the policy scores the engine's samples
    assert scored.logprobs.shape == batch.rollout_logprobs.shape == (4, 4)
    assert torch.allclose(batch.rollout_logprobs, torch.tensor(-math.log(12)))
    with pytest.raises(ValueError, match="^precision must be"):
        UniformSampler.check_args(precision="int8")

    task = Reverse(length=3)
    sample = task.sample(random.Random(0))
    assert sample.prompt.endswith(">") and sample.solution == sample.prompt[:3][::-1]
    assert task([sample.prompt] * 2, [sample.solution, "x"], answer=[sample.solution] * 2) == [1.0, 0.0]


@pytest.fixture
def registered(monkeypatch) -> Iterator[None]:
    """Step 2 for every toy: its line in the registry (``"toy": Toy``); the schemas that generates are dropped
    from Hydra's ConfigStore afterwards."""
    for registry, toy, _ in TOYS.values():
        monkeypatch.setitem(registry, "toy", toy)
    yield
    for group in TOYS:
        ConfigStore.instance().repo["schema"][group].pop("toy.yaml", None)


def test_step_2_the_registry_line_builds_it_by_name_and_gives_it_a_schema(registered):
    assert isinstance(build_corrector("toy", scale=0.5), ScaledWeights)
    assert isinstance(get_task("toy", length=4), Reverse)
    assert isinstance(build_engine("toy", build_tiny_qwen3(seed=0), vocab=5), UniformSampler)
    with pytest.raises(ValueError, match="^vocab must be"):
        build_engine("toy", build_tiny_qwen3(seed=0), vocab=1)

    compose_train_config([])  # registers every schema of the registries, the toys' too
    store = ConfigStore.instance()
    schemas = {group: store.load(f"schema/{group}/toy.yaml").node for group in TOYS}
    assert dict(schemas["corrector"]) == {"_target_": f"{__name__}.ScaledWeights", "scale": 0.5}
    assert dict(schemas["rollout"]) == {
        "_target_": f"{__name__}.UniformSampler",
        "_partial_": True,
        "precision": "fp32",
        "vocab": 20,
    }  # the constructor's arguments but the model, which the run passes
    assert dict(schemas["task"]) == {"_target_": f"{__name__}.Reverse", "length": 3}
    assert dict(schemas["policy"]) == {"_target_": f"{__name__}.OneLayerQwen3", "layers": 1}


def _options(root: Path) -> Path:
    """Step 3 for every toy: ``conf/<group>/toy.yaml``, starting from the schema."""
    for group, (_, _, values) in TOYS.items():
        (root / "conf" / group).mkdir(parents=True, exist_ok=True)
        (root / "conf" / group / "toy.yaml").write_text(
            f"defaults:\n  - /schema/{group}/toy@_here_\n  - _self_\n{values}"
        )
    return root / "conf"


TOY_OPTIONS = ["corrector=toy", "rollout=toy", "task=toy", "policy=toy"]


def test_step_3_one_yaml_makes_it_an_option_of_ais_train(registered, tmp_path: Path):
    conf = _options(tmp_path)
    search = f"hydra.searchpath=[file://{conf}]"
    cfg = compose_train_config([search, *TOY_OPTIONS, "experiment=smoke", f"output_dir={tmp_path / 'run'}"])
    components = validate(cfg)
    assert isinstance(components.corrector, ScaledWeights) and components.corrector.scale == 0.25
    assert components.engine.engine_class is UniformSampler
    assert components.engine.checked_arguments == {"precision": "fp32", "vocab": 12}
    assert isinstance(components.task, Reverse) and components.task.length == 2
    assert isinstance(components.policy, OneLayerQwen3) and components.policy.layers == 1

    with pytest.raises(ConfigCompositionException, match="scael"):  # the schema knows the toy's keys
        compose_train_config([search, "corrector=toy", "corrector.scael=0.5", f"output_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"^corrector\.scale must be in \(0, 1\]"):  # its values, named
        validate(
            compose_train_config([search, "corrector=toy", "corrector.scale=2.0", f"output_dir={tmp_path}"])
        )


@pytest.mark.slow  # one in-process ais-train run of two steps (about 10 s)
def test_ais_train_trains_with_the_four_toys(registered, tmp_path: Path, monkeypatch):
    from ais_lightning.app.train import run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(UniformSampler, "syncs", [])
    monkeypatch.setattr(OneLayerQwen3, "built", [])
    out = tmp_path / "run"
    overrides = [f"hydra.searchpath=[file://{_options(tmp_path)}]", *TOY_OPTIONS, "experiment=smoke"]
    threads = torch.get_num_threads()
    try:
        summary = run(
            compose_train_config([*overrides, "trainer.num_threads=1", "logger=csv", f"output_dir={out}"])
        )
    finally:
        torch.set_num_threads(threads)
    assert summary["status"] == "finished" and summary["steps"] == 2 and summary["task"] == "reverse"
    rows = list(csv.DictReader((out / "csv" / "version_0" / "metrics.csv").open()))
    assert [float(r["toy/scale"]) for r in rows if r.get("toy/scale")] == [
        0.25,
        0.25,
    ]  # the corrector, each step
    assert [float(r["corrector/weight_mean"]) for r in rows if r.get("corrector/weight_mean")] == [0.25, 0.25]
    rewards = [float(r["reward/mean"]) for r in rows if r.get("reward/mean")]
    assert len(rewards) == 2 and all(0 <= r <= 1 for r in rewards)  # the task scored every step's samples
    assert OneLayerQwen3.built == [1]  # the policy spec built the run's policy
    assert len(UniformSampler.syncs) >= 2 and all(
        n > 0 for n in UniformSampler.syncs
    )  # the engine got weights
