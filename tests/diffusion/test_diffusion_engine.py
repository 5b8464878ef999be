"""DiffusionRolloutEngine: the LLaDA sampler's invariants, seeds, greedy, weight sync, argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ais_lightning.models import build_tiny_diffusion
from ais_lightning.quant import QuantLinear
from ais_lightning.rollout.base import SamplingConfig
from ais_lightning.rollout.diffusion_engine import (
    DenoisingStep,
    DiffusionRolloutEngine,
    denoising_schedule,
    response_end_mask,
)

MASK = 99
PROMPTS = [[20, 21, 14, 22, 23, 32], [24, 14, 25, 32], [3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def model():
    return build_tiny_diffusion(seed=0)


def _sampling(**kw):
    base = dict(n=3, temperature=1.0, max_new_tokens=8, stop_token_ids=[2], seed=7)
    base.update(kw)
    return SamplingConfig(**base)


def _assert_same_batch(a, b):
    for name in (
        "prompt_ids",
        "prompt_mask",
        "response_ids",
        "response_mask",
        "rollout_logprobs",
        "prompt_index",
    ):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.finish_reason == b.finish_reason
    assert a.extras.keys() == b.extras.keys()
    assert all(torch.equal(a.extras[k], b.extras[k]) for k in a.extras)


# ---------------------------------------------------------------------------------------------- schedule
def test_schedule_matches_llada_when_divisible():
    # LLaDA generate(steps=4, gen_length=8, block_length=4): 2 steps per block, 2 tokens per step.
    assert denoising_schedule(8, steps=4, block_length=4) == [
        DenoisingStep(0, 4, 2),
        DenoisingStep(0, 4, 2),
        DenoisingStep(4, 8, 2),
        DenoisingStep(4, 8, 2),
    ]
    # get_num_transfer_tokens: 5 masked tokens over 2 steps -> [3, 2].
    assert [s.num_unmask for s in denoising_schedule(5, steps=2)] == [3, 2]
    assert denoising_schedule(3) == [DenoisingStep(0, 3, 1)] * 3  # default: one token per step


@pytest.mark.parametrize(
    "length, steps, block", [(8, None, None), (8, 3, 3), (7, 20, 2), (9, 2, 4), (1, 1, 5)]
)
def test_schedule_invariants(length, steps, block):
    schedule = denoising_schedule(length, steps, block)
    assert all(1 <= step.num_unmask <= step.block_end - step.block_start for step in schedule)
    covered = torch.zeros(length, dtype=torch.long)
    for start in sorted({s.block_start for s in schedule}):
        block_steps = [s for s in schedule if s.block_start == start]
        size = block_steps[0].block_end - start
        assert sum(s.num_unmask for s in block_steps) == size  # every position of the block exactly once
        covered[start : start + size] += 1
    assert torch.equal(covered, torch.ones(length, dtype=torch.long))
    starts = [s.block_start for s in schedule]
    assert starts == sorted(starts)  # blocks left to right


def test_schedule_rejects_bad_arguments():
    for kwargs in ({"length": 0}, {"length": 4, "steps": 0}, {"length": 4, "block_length": -1}):
        with pytest.raises(ValueError):
            denoising_schedule(**kwargs)


def test_response_end_mask_by_hand():
    canvas = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 2, 2, 2]])
    mask, stopped = response_end_mask(canvas, [2])
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]
    assert stopped.tolist() == [True, False, True]
    mask, stopped = response_end_mask(canvas, [])
    assert mask.all() and not stopped.any()


# ---------------------------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
@pytest.mark.parametrize("block_length, steps", [(None, None), (3, None), (4, 4)])
def test_sampler_invariants(model, remasking, block_length, steps):
    engine = DiffusionRolloutEngine(model, remasking=remasking, block_length=block_length, steps=steps)
    sampling = _sampling(stop_token_ids=list(range(30, 40)))  # frequent stops: some rows stop, some not
    out = engine.generate(PROMPTS, sampling)
    b, t = 3 * len(PROMPTS), sampling.max_new_tokens
    canvas, step = out.extras["canvas_ids"], out.extras["unmask_step"]
    assert out.response_ids.shape == out.response_mask.shape == canvas.shape == step.shape == (b, t)
    assert out.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert not (canvas == MASK).any()  # every position was unmasked ...
    schedule = engine.schedule(t)
    assert step.min() >= 0 and step.max() == len(schedule) - 1
    for s, planned in enumerate(schedule):  # ... exactly once, by the step planned for it, inside its block
        at_s = step == s
        assert torch.equal(at_s.sum(-1), torch.full((b,), planned.num_unmask))
        cols = at_s.nonzero()[:, 1]
        assert ((cols >= planned.block_start) & (cols < planned.block_end)).all()
    # Response = canvas up to the first stop token, padded after; finish reasons agree.
    mask, stopped = response_end_mask(canvas, sampling.stop_token_ids)
    assert torch.equal(out.response_mask, mask)
    assert out.finish_reason == ["stop" if s else "length" for s in stopped.tolist()]
    assert {"stop", "length"} == set(out.finish_reason)
    assert torch.equal(out.response_ids, torch.where(mask, canvas, 0))
    assert (out.rollout_logprobs[~mask] == 0).all() and (out.rollout_logprobs[mask] < 0).all()
    assert torch.equal(out.rollout_logprobs, torch.where(mask, out.extras["canvas_logprobs"], 0.0))
    assert (out.extras["canvas_logprobs"] < 0).all()  # the tail is scored too


def test_blocks_are_denoised_left_to_right(model):
    engine = DiffusionRolloutEngine(model, block_length=3)
    step = engine.generate(PROMPTS, _sampling(max_new_tokens=8)).extras["unmask_step"]
    for lo, hi in ((0, 3), (3, 6)):
        assert (step[:, lo:hi].max(-1).values < step[:, hi : hi + 3].min(-1).values).all()


def test_seeds_reproduce_and_differ(model):
    engine = DiffusionRolloutEngine(model)
    a, b = engine.generate(PROMPTS, _sampling(seed=1)), engine.generate(PROMPTS, _sampling(seed=1))
    _assert_same_batch(a, b)
    c = engine.generate(PROMPTS, _sampling(seed=2))
    assert not torch.equal(a.extras["canvas_ids"], c.extras["canvas_ids"])
    # The global RNG is not consumed by a seeded draw.
    state = torch.random.get_rng_state()
    engine.generate(PROMPTS, _sampling(seed=3))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_greedy_is_deterministic_and_scored_at_temperature_one(model):
    engine = DiffusionRolloutEngine(model, block_length=4)
    a = engine.generate(PROMPTS, _sampling(temperature=0.0, seed=1))
    b = engine.generate(PROMPTS, _sampling(temperature=0.0, seed=99))
    _assert_same_batch(a, b)
    assert torch.equal(a.response_ids[0], a.response_ids[1])  # the n samples of a prompt coincide
    from ais_lightning.policy import DiffusionPolicy

    pi = DiffusionPolicy(model).batch_logprobs(a, temperature=1.0).logprobs.detach()
    torch.testing.assert_close(pi, a.rollout_logprobs, rtol=0, atol=1e-5)


def test_greedy_low_confidence_matches_a_step_by_step_llada_loop(model):
    """An independent, literal re-implementation of LLaDA's generate.py loop (argmax candidates, confidence =
    softmax probability, per-row top-k inside the current block) gives the engine's canvas."""
    length, block = 6, 3
    engine = DiffusionRolloutEngine(model, block_length=block, steps=4)
    out = engine.generate(PROMPTS, _sampling(n=1, temperature=0.0, max_new_tokens=length))
    x = torch.cat([out.prompt_ids, torch.full((len(PROMPTS), length), MASK)], dim=1)
    attention = torch.cat([out.prompt_mask, torch.ones(len(PROMPTS), length, dtype=torch.bool)], dim=1)
    plen = out.prompt_ids.shape[1]
    with torch.no_grad():
        for num_block in range(2):
            for k in (2, 1):  # 2 steps per block: 3 tokens -> [2, 1]
                logits = model(x, attention_mask=attention)
                x0 = logits.argmax(-1)
                p = F.softmax(logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1)
                p[:, plen + (num_block + 1) * block :] = -float("inf")
                confidence = torch.where(x == MASK, p, -float("inf"))
                for j in range(x.shape[0]):
                    idx = confidence[j].topk(k).indices
                    x[j, idx] = x0[j, idx]
    assert torch.equal(x[:, plen:], out.extras["canvas_ids"])


def test_prompts_and_sampling_are_checked(model):
    engine = DiffusionRolloutEngine(model)
    with pytest.raises(ValueError, match="mask token"):
        engine.generate([[5, MASK]], _sampling())
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[5, 100]], _sampling())
    with pytest.raises(ValueError, match="non-empty"):
        engine.generate([], _sampling())


# ------------------------------------------------------------------------------------------ weight sync
def _perturbed_state(model, scale=0.05, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            n,
            t + scale * torch.randn(t.shape, generator=gen)
            if t.is_floating_point() and "inv_freq" not in n
            else t,
        )
        for n, t in model.state_dict().items()
    ]


@pytest.mark.parametrize("precision", ["fp32", "int8", "fp8"])
def test_synced_engine_equals_fresh_engine(model, precision):
    """An engine synced to new weights (re-quantized) samples exactly like one built on those weights."""
    target = build_tiny_diffusion(seed=0)
    target.load_state_dict(dict(_perturbed_state(model)))
    synced = DiffusionRolloutEngine(model, precision=precision)
    before = synced.generate(PROMPTS, _sampling())
    synced.sync_weights(target.state_dict().items())
    fresh = DiffusionRolloutEngine(target, precision=precision)
    after = synced.generate(PROMPTS, _sampling())
    _assert_same_batch(after, fresh.generate(PROMPTS, _sampling()))
    assert not torch.equal(after.rollout_logprobs, before.rollout_logprobs)
    if precision != "fp32":
        assert any(isinstance(m, QuantLinear) for m in synced.model.modules())
        assert not any(isinstance(m, QuantLinear) for m in model.modules())  # the caller's model is untouched


@pytest.mark.parametrize(
    "bad, match",
    [
        (("model.layers.9.mlp.up_proj.weight", torch.zeros(384, 128)), "model.layers.9.mlp.up_proj.weight"),
        (("model.norm.weight", torch.zeros(7)), "shape"),
        (("model.norm.weight", torch.full((128,), float("nan"))), "non-finite"),
        (("model.norm.weight", "not a tensor"), "torch.Tensor"),
    ],
)
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_rejected_sync_leaves_the_engine_unchanged(model, bad, match, precision):
    engine = DiffusionRolloutEngine(model, precision=precision)
    before_state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    before = engine.generate(PROMPTS, _sampling())
    good = _perturbed_state(model)[:5]  # valid tensors first: none of them may be written
    with pytest.raises(ValueError, match=match):
        engine.sync_weights(good + [bad])
    state = engine.model.state_dict()
    assert all(torch.equal(state[k], before_state[k]) for k in before_state)
    _assert_same_batch(engine.generate(PROMPTS, _sampling()), before)


def test_unknown_names_are_all_listed(model):
    engine = DiffusionRolloutEngine(model)
    with pytest.raises(ValueError, match=r"2 names.*'a\.weight', 'b\.weight'"):
        engine.sync_weights([("b.weight", torch.zeros(1)), ("a.weight", torch.zeros(1))])


# -------------------------------------------------------------------------------------------- arguments
def test_check_args_defaults_and_errors(int8_isa):
    args = DiffusionRolloutEngine.check_args(precision="int8")
    assert args == {
        "precision": "int8",
        "backend": {"vnni": "int8", "avx2": "fbgemm"}[int8_isa],  # the CPU's fastest exact integer GEMM
        "steps": None,
        "block_length": None,
        "remasking": "low_confidence",
        "pad_token_id": None,
        "mask_token_id": None,
    }
    assert DiffusionRolloutEngine.check_args(precision="fp8")["backend"] == "emulate"
    assert DiffusionRolloutEngine.check_args()["backend"] is None
    bad = [
        ({"precision": "fp16"}, "precision"),
        ({"precision": "fp32", "backend": "emulate"}, "backend"),
        ({"precision": "fp8", "backend": "int8"}, "backend"),
        ({"precision": "int8", "backend": "cuda"}, "backend"),
        ({"precision": "fp4", "backend": "fbgemm"}, "backend='fbgemm'"),
        ({"steps": 0}, "steps"),
        ({"block_length": 2.5}, "block_length"),
        ({"steps": True}, "steps"),
        ({"remasking": "top_p"}, "remasking"),
        ({"pad_token_id": -1}, "pad_token_id"),
        ({"kv_cache_dtype": "fp8"}, "unknown"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            DiffusionRolloutEngine.check_args(**kwargs)
    with pytest.raises(ValueError, match="remasking"):
        DiffusionRolloutEngine(build_tiny_diffusion(seed=0), remasking="top_p")  # the constructor calls it


def test_trainer_precision_copy_keeps_the_sampler():
    rollout = {"precision": "fp4", "block_length": 4, "remasking": "random"}
    args = DiffusionRolloutEngine.check_args(**{**rollout, **DiffusionRolloutEngine.TRAINER_PRECISION_COPY})
    assert (args["precision"], args["backend"], args["block_length"], args["remasking"]) == (
        "fp32",
        None,
        4,
        "random",
    )


def test_engine_needs_a_mask_predictor():
    with pytest.raises(ValueError, match="get_decoder"):
        DiffusionRolloutEngine(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("precision", ["bf16", "fp4"])
def test_low_precisions_run(model, precision):
    out = DiffusionRolloutEngine(model, precision=precision).generate(PROMPTS, _sampling())
    assert torch.isfinite(out.rollout_logprobs).all()
    assert not (out.extras["canvas_ids"] == MASK).any()
