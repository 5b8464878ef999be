"""Progressive precision for the aligned trainer (issue #18): the schedule option, the policy's stage switch,
the engine's in-place precision switch, and every nested recipe through weight sync and checkpoints."""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch

from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.policy import Policy, TinyQwen3
from ais_lightning.policy.builders import check_aligned_schedule_engine
from ais_lightning.policy.policy import check_aligned_schedule
from ais_lightning.quant import NESTED_INT_RECIPES, QuantLinear
from ais_lightning.rollout import RolloutEngine, SamplingConfig, TorchRolloutEngine

PROMPTS = [[20, 14, 21, 32], [25, 14, 29, 32], [23, 14, 20, 32]]
SAMPLING = SamplingConfig(n=2, max_new_tokens=6, seed=3)
SCHEDULE = [[0, "int8_nested"], [2, "int4"], [5, "int2"]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    return build_tiny_qwen3(seed=0).eval()


@pytest.fixture(scope="module")
def trained(model):
    """``model`` after one SGD step on a fixed batch (the weights a sync carries)."""
    out = copy.deepcopy(model).train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [40, 41, 42, 43, 44, 45]])
    out(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in out.parameters():
            p -= 1.0 * p.grad  # a large step that leaves the policy non-degenerate
    return out.eval()


def _recipes(module) -> set[str]:
    return {m.recipe.name for m in module.modules() if isinstance(m, QuantLinear)}


def _logprobs(policy: Policy, batch) -> torch.Tensor:
    with torch.no_grad():
        return policy.batch_logprobs(batch).logprobs


def _same_rollouts(a, b) -> bool:
    return torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)


# ------------------------------------------------------------------------------------------- the option
def test_schedule_is_normalized_and_sets_the_first_recipe():
    assert check_aligned_schedule(SCHEDULE) == ((0, "int8_nested"), (2, "int4"), (5, "int2"))
    assert check_aligned_schedule([(0, "fp8")], "fp8_block") == ((0, "fp8"),)  # an alias is the same recipe
    spec = TinyQwen3(aligned_schedule=[[0, "int4_w"], [10, "int2_w"]])
    assert spec.aligned_quantization == "int4_w"
    assert spec.aligned_schedule == [[0, "int4_w"], [10, "int2_w"]]


@pytest.mark.parametrize(
    "schedule, aligned, match",
    [
        ([], None, "non-empty"),
        ("int4", None, "non-empty"),
        ([[0, "int4", 3]], None, r"aligned_schedule\[0\] must be a \[start_step, recipe\] pair"),
        ([[0, "int3"]], None, r"aligned_schedule\[0\] recipe 'int3' is not a quantization recipe"),
        ([[0, "int8_nested"], [0, "int4"]], None, "increase strictly"),
        ([[0, "int8_nested"], [5, "int4"], [3, "int2"]], None, "increase strictly"),
        ([[1, "int4"]], None, "first stage must start at step 0"),
        ([[-1, "int4"]], None, "int >= 0"),
        ([[0.5, "int4"]], None, "int >= 0"),
        ([[0, "int8_nested"], [5, "int4"]], "int4", "contradicts aligned_schedule"),
    ],
)
def test_bad_schedules_raise(schedule, aligned, match):
    with pytest.raises(ValueError, match=match):
        check_aligned_schedule(schedule, aligned)
    with pytest.raises(ValueError, match=match):
        TinyQwen3(aligned_quantization=aligned, aligned_schedule=schedule)


def test_the_engine_must_follow_the_schedule():
    schedule = check_aligned_schedule(SCHEDULE)
    check_aligned_schedule_engine(schedule, functools.partial(TorchRolloutEngine, precision="int8_nested"))
    check_aligned_schedule_engine(None, functools.partial(TorchRolloutEngine, precision="int8"))
    check_aligned_schedule_engine(schedule, lambda m: TorchRolloutEngine(m))  # not inspectable: skipped
    with pytest.raises(
        ValueError, match="rollout.precision='int4' must be the first stage's recipe 'int8_nested'"
    ):
        check_aligned_schedule_engine(schedule, functools.partial(TorchRolloutEngine, precision="int4"))
    with pytest.raises(ValueError, match="rollout.backend=emulate"):  # an integer GEMM cannot switch recipes
        check_aligned_schedule_engine(
            ((0, "int8"), (3, "int4")),
            functools.partial(TorchRolloutEngine, precision="int8", backend="int8"),
        )
    check_aligned_schedule_engine(
        ((0, "int8"), (3, "int4")), functools.partial(TorchRolloutEngine, precision="int8", backend="emulate")
    )
    with pytest.raises(ValueError, match=r"aligned_schedule\[1\] 'mxfp4' is no emulated precision"):
        check_aligned_schedule_engine(
            ((0, "int4"), (3, "mxfp4")), functools.partial(TorchRolloutEngine, precision="int4")
        )

    class FixedPrecisionEngine(RolloutEngine):  # an engine that cannot switch in place
        def __init__(self, model, precision="fp32"):
            pass

        def sync_weights(self, named_tensors):
            pass

        def generate(self, prompts, sampling):
            raise AssertionError("never built")

    with pytest.raises(ValueError, match="cannot switch its precision in place"):
        check_aligned_schedule_engine(
            schedule, functools.partial(FixedPrecisionEngine, precision="int8_nested")
        )


# ---------------------------------------------------------------------------------- the trainer's side
def test_policy_walks_the_stages_and_keeps_its_master_weights(model):
    policy = Policy(copy.deepcopy(model), build_char_tokenizer(), aligned_schedule=SCHEDULE)
    assert policy.aligned_quantization == "int8_nested"
    masters = {k: v.clone() for k, v in policy.model.state_dict().items()}
    batch = TorchRolloutEngine(model, precision="int8_nested").generate(PROMPTS, SAMPLING)
    assert policy.set_aligned_step(0) == "int8_nested" and _recipes(policy.model) == {"int8_nested"}
    first = _logprobs(policy, batch)
    seen = {}
    for step in range(7):
        recipe = policy.set_aligned_step(step)
        assert recipe == policy.aligned_recipe_at(step) and _recipes(policy.model) == {recipe}
        assert policy.aligned_stage_at(step) == (0 if step < 2 else 1 if step < 5 else 2)
        seen.setdefault(recipe, _logprobs(policy, batch))
    assert list(seen) == ["int8_nested", "int4", "int2"]
    assert not torch.equal(seen["int4"], seen["int2"])  # the stages really run different grids
    for k, v in policy.model.state_dict().items():  # the switches never touched the fp32 masters
        assert torch.equal(v, masters[k]), k
    policy.set_aligned_step(0)  # switching back is lossless
    assert torch.equal(_logprobs(policy, batch), first)


def test_policy_without_a_schedule_has_one_stage(model):
    plain = Policy(copy.deepcopy(model))
    assert plain.set_aligned_step(3) is None and plain.aligned_stage_at(3) == 0 and not _recipes(plain.model)
    one = Policy(copy.deepcopy(model), aligned_quantization="int4")
    assert one.set_aligned_step(100) == "int4" and _recipes(one.model) == {"int4"}


# ------------------------------------------------------------------------------------ the engine's side
@pytest.mark.parametrize("start, target", [("int8_nested", "int4"), ("int4", "int2_w_ocs"), ("fp8", "int2")])
def test_engine_switch_equals_an_engine_built_at_the_new_precision(model, trained, start, target):
    engine = TorchRolloutEngine(model, precision=start)
    engine.sync_weights(Policy(trained).full_state_dict())
    before = engine.generate(PROMPTS, SAMPLING)
    engine.set_precision(target)
    assert engine.precision == target and _recipes(engine.model) == {target}
    fresh = TorchRolloutEngine(trained, precision=target).generate(PROMPTS, SAMPLING)
    after = engine.generate(PROMPTS, SAMPLING)
    assert _same_rollouts(after, fresh)
    assert not _same_rollouts(after, before)
    engine.set_precision(start)  # and back: the master weights it holds were never changed
    assert _same_rollouts(engine.generate(PROMPTS, SAMPLING), before)


def test_engine_switch_recalibrates_the_fp8_kv_scales(model):
    engine = TorchRolloutEngine(model, precision="int8_nested", kv_cache_dtype="fp8")
    engine.set_precision("int4")
    fresh = TorchRolloutEngine(model, precision="int4", kv_cache_dtype="fp8")
    assert _same_rollouts(engine.generate(PROMPTS, SAMPLING), fresh.generate(PROMPTS, SAMPLING))


@pytest.mark.parametrize(
    "precision, backend, target, match",
    [
        ("int8", "int8", "int4", "switches between emulated quantized precisions"),  # integer-GEMM engines
        ("int8", "fbgemm", "int4", "switches between emulated quantized precisions"),
        ("fp32", None, "int4", "switches between emulated quantized precisions"),
        ("int4", None, "fp32", "switches between emulated quantized precisions"),
        ("int4", None, "int3", "precision must be one of"),
    ],
)
def test_engine_refuses_switches_it_cannot_make(model, precision, backend, target, match):
    engine = TorchRolloutEngine(model, precision=precision, backend=backend)
    before = engine.generate(PROMPTS, SAMPLING)
    with pytest.raises(ValueError, match=match):
        engine.set_precision(target)
    assert engine.precision == precision
    assert _same_rollouts(engine.generate(PROMPTS, SAMPLING), before)


def test_same_precision_is_a_no_op(model):
    engine = TorchRolloutEngine(model, precision="int4")
    layer = next(m for m in engine.model.modules() if isinstance(m, QuantLinear))
    cache = layer.weight_fq
    engine.set_precision("int4")
    assert layer.weight_fq is cache


# ---------------------------------------------------- acceptance: every new recipe through sync and checkpoint
@pytest.mark.parametrize("recipe", NESTED_INT_RECIPES)
def test_every_nested_recipe_round_trips_through_sync_and_checkpoint(model, trained, recipe):
    # weight sync: an engine synced to new weights equals one built from them
    engine = TorchRolloutEngine(model, precision=recipe)
    engine.generate(PROMPTS, SAMPLING)
    engine.sync_weights(Policy(trained).full_state_dict())
    synced = engine.generate(PROMPTS, SAMPLING)
    assert _same_rollouts(synced, TorchRolloutEngine(trained, precision=recipe).generate(PROMPTS, SAMPLING))
    assert not _same_rollouts(synced, TorchRolloutEngine(model, precision=recipe).generate(PROMPTS, SAMPLING))

    # checkpoint: the aligned policy's state dict (fp32 masters, no caches) restores the same forward
    policy = Policy(copy.deepcopy(trained), aligned_quantization=recipe)
    policy.apply_aligned_quantization()
    buffer = io.BytesIO()
    torch.save(policy.state_dict(), buffer)
    assert set(policy.state_dict()) == set(Policy(trained).state_dict())  # names as without quantization
    restored = Policy(build_tiny_qwen3(seed=1), aligned_quantization=recipe)
    restored.apply_aligned_quantization()
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(_logprobs(restored, synced), _logprobs(policy, synced))
    assert _recipes(restored.model) == {recipe}
    # and the restored policy's sync gives the same engine
    engine.sync_weights(restored.full_state_dict())
    assert _same_rollouts(engine.generate(PROMPTS, SAMPLING), synced)
