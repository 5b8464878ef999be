"""TorchRolloutEngine: parity with the fp32 Policy, quantization mismatch, stops, seeds, weight sync."""

import copy

import pytest
import torch

from ais_lightning.models import build_tiny_qwen3
from ais_lightning.policy import Policy
from ais_lightning.quant import QuantLinear
from ais_lightning.rollout import RolloutEngine, SamplingConfig, TorchRolloutEngine
from ais_lightning.rollout.prompts import left_pad
from ais_lightning.rollout.torch_model import act_in_place, linear_residual, rope, sign_sin

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [40], [20, 21, 22, 23]]  # different lengths


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    return build_tiny_qwen3(seed=0).eval()


def _policy_logprobs(model, batch, temperature):
    with torch.no_grad():
        out = Policy(model).response_logprobs(
            batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, temperature
        )
    return out.logprobs


def _k3(model, batch, temperature=1.0):
    """Mean k3 estimate of KL(mu || pi) over valid tokens: E[w - 1 - log w], w = pi / mu."""
    delta = _policy_logprobs(model, batch, temperature) - batch.rollout_logprobs
    delta = delta[batch.response_mask]
    return float((delta.exp() - 1 - delta).mean())


def test_is_a_rollout_engine(model):
    assert isinstance(TorchRolloutEngine(model), RolloutEngine)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_logprobs_match_policy(model, temperature):
    engine = TorchRolloutEngine(model, precision="fp32")
    sampling = SamplingConfig(n=3, temperature=temperature, max_new_tokens=12, stop_token_ids=[2], seed=0)
    batch = engine.generate(PROMPTS, sampling)
    assert batch.response_ids.shape[0] == len(PROMPTS) * 3
    lp = _policy_logprobs(model, batch, temperature)
    mask = batch.response_mask
    assert (lp - batch.rollout_logprobs)[mask].abs().max().item() < 1e-5
    assert (batch.rollout_logprobs[~mask] == 0).all()


def test_engine_does_not_modify_callers_model(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    TorchRolloutEngine(model, precision="int8").generate(PROMPTS, SamplingConfig(max_new_tokens=2, seed=0))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any("Quant" in type(m).__name__ for m in model.modules())


def test_greedy_matches_hf_generate(model):
    engine = TorchRolloutEngine(model)
    batch = engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=8))
    ids, mask = left_pad(PROMPTS, 0)
    with torch.no_grad():
        ref = model.generate(
            input_ids=ids, attention_mask=mask.long(), do_sample=False, max_new_tokens=8, min_new_tokens=8,
            pad_token_id=0,
        )  # fmt: skip
    assert torch.equal(batch.response_ids, ref[:, ids.shape[1] :])
    assert batch.finish_reason == ["length"] * len(PROMPTS)


def test_rows_are_grouped_by_prompt(model):
    batch = TorchRolloutEngine(model).generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=3, seed=1))
    assert batch.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    ids, mask = left_pad(PROMPTS, 0)
    assert torch.equal(batch.prompt_ids, ids.repeat_interleave(2, 0))
    assert torch.equal(batch.prompt_mask, mask.repeat_interleave(2, 0))


def test_stop_tokens_end_responses_and_mask_after(model):
    stops = list(range(3, 60))  # more than half the vocabulary: most rows stop within a few tokens
    sampling = SamplingConfig(n=4, max_new_tokens=10, stop_token_ids=stops, seed=3)
    batch = TorchRolloutEngine(model).generate(PROMPTS, sampling)
    assert "stop" in batch.finish_reason
    for row in range(batch.response_ids.shape[0]):
        ids, m = batch.response_ids[row], batch.response_mask[row]
        n_valid = int(m.sum())
        assert m[:n_valid].all() and not m[n_valid:].any()  # valid tokens are a prefix
        is_stop = torch.tensor([int(t) in stops for t in ids[:n_valid]])
        if batch.finish_reason[row] == "stop":
            assert is_stop[-1] and not is_stop[:-1].any()
        else:
            assert n_valid == 10 and not is_stop.any()
        assert (ids[n_valid:] == 0).all() and (batch.rollout_logprobs[row, n_valid:] == 0).all()


@pytest.mark.parametrize("compact_below", [0.0, 0.9])
def test_logprobs_match_policy_when_rows_stop_early(model, compact_below):
    """With most rows stopping early, finished rows are dropped from the cache (0.9) or kept (0.0)."""
    sampling = SamplingConfig(n=4, max_new_tokens=10, stop_token_ids=list(range(3, 23)), seed=11)
    batch = TorchRolloutEngine(model, compact_below=compact_below).generate(PROMPTS, sampling)
    lengths = batch.response_mask.sum(-1)
    assert lengths.min() < 4 and lengths.max() > 6  # rows finish at different steps
    lp = _policy_logprobs(model, batch, 1.0)
    assert (lp - batch.rollout_logprobs)[batch.response_mask].abs().max().item() < 1e-5


def test_kv_cache_memory_is_reused_and_stale_contents_never_read(model):
    engine = TorchRolloutEngine(model)
    big = SamplingConfig(n=4, max_new_tokens=12, seed=0)
    engine.generate(PROMPTS, big)
    workspace = engine.kv_workspace.buffer
    with torch.inference_mode():
        workspace.fill_(float("nan"))  # whatever a previous call left must not leak into the next one
    small = SamplingConfig(n=2, max_new_tokens=6, stop_token_ids=[2], seed=3)
    reused = engine.generate(PROMPTS[1:], small)  # fewer rows, padded prompts: fits in the workspace
    assert engine.kv_workspace.buffer is workspace
    fresh = TorchRolloutEngine(model).generate(PROMPTS[1:], small)
    assert torch.equal(reused.response_ids, fresh.response_ids)
    assert torch.equal(reused.rollout_logprobs, fresh.rollout_logprobs)
    engine.release_kv_cache()
    assert engine.kv_workspace.buffer is None
    assert torch.equal(engine.generate(PROMPTS[1:], small).response_ids, fresh.response_ids)


def test_seeds_reproduce(model):
    engine = TorchRolloutEngine(model)
    a = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=8, seed=5))
    b = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=8, seed=5))
    c = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=8, seed=6))
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_quantized_engines_have_mismatch_fp4_above_fp8(model):
    prompts = [[i, i + 1, i + 2] for i in range(3, 60, 4)]
    sampling = SamplingConfig(n=4, max_new_tokens=16, seed=0)
    kl = {
        p: _k3(model, TorchRolloutEngine(model, precision=p).generate(prompts, sampling))
        for p in ("fp8", "fp4", "int8")
    }
    assert all(v > 1e-6 for v in kl.values()), kl
    assert kl["fp4"] > kl["fp8"], kl
    assert _k3(model, TorchRolloutEngine(model).generate(prompts, sampling)) < 1e-9


@pytest.mark.parametrize(
    "precision, backend, fused_type",
    [
        ("fp32", None, "Linear"),
        ("int8", "int8", "QuantLinear"),
        ("int8", "fbgemm", "QuantLinear"),
        ("int8", "emulate", None),
        ("fp8", None, None),
    ],
)
def test_fused_qkv_equals_the_three_projections(model, precision, backend, fused_type):
    """The fused q/k/v layer of an integer GEMM reproduces the three modules bit for bit (one shared activation
    scale, and one set of outlier channels, picked from the same input); so does its fused gate/up."""
    engine = TorchRolloutEngine(model, precision=precision, backend=backend)
    engine.generate(PROMPTS, SamplingConfig(max_new_tokens=2, seed=0))  # calibrates the outlier channels
    h = torch.randn(5, model.config.hidden_size)
    for i, layer in enumerate(engine.model.model.layers):
        fused, gate_up = engine.lean.qkv[i], engine.lean.gate_up[i]
        assert (type(fused).__name__ if fused is not None else None) == fused_type
        assert (gate_up is not None) == (backend in ("int8", "fbgemm"))
        attn, mlp = layer.self_attn, layer.mlp
        with torch.inference_mode():
            if fused is not None:
                for m in (attn.q_proj, attn.k_proj, attn.v_proj):  # the separate modules, calibrated alike
                    if isinstance(m, QuantLinear):
                        m.set_outlier_channels(fused.outlier_channels)
                separate = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
                assert torch.equal(fused(h), separate)
            if gate_up is not None:
                for m in (mlp.gate_proj, mlp.up_proj):
                    m.set_outlier_channels(gate_up.outlier_channels)
                assert torch.equal(gate_up(h), torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], dim=-1))


def test_both_integer_gemms_roll_out_alike(model):
    """``torch._int_mm`` and fbgemm compute the int8 recipe's integers, scaled alike: the same rollouts bit for bit,
    also after a weight sync (the tiny model's sums are exact in fp32)."""
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    sampling = SamplingConfig(n=2, max_new_tokens=8, seed=0)
    engines = [TorchRolloutEngine(model, precision="int8", backend=b) for b in ("int8", "fbgemm")]
    for weights in (None, Policy(trained).full_state_dict()):
        if weights is not None:
            for engine in engines:
                engine.sync_weights(weights)
        a, b = (engine.generate(PROMPTS, sampling) for engine in engines)
        assert torch.equal(a.response_ids, b.response_ids)
        assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)


def test_silu_runs_in_place_and_other_activations_do_not(model):
    """The lean MLP overwrites the gate output with SiLU(gate) (bit-identical); other activations allocate."""
    act = model.model.layers[0].mlp.act_fn  # HF's SiLUActivation
    for silu in (act, torch.nn.SiLU()):
        x = torch.randn(4, 7)
        expected = torch.nn.functional.silu(x)
        out = act_in_place(silu, x)
        assert out.data_ptr() == x.data_ptr() and torch.equal(out, expected)
    x = torch.randn(4, 7)
    before = x.clone()
    out = act_in_place(torch.nn.GELU(), x)
    assert torch.equal(x, before) and torch.equal(out, torch.nn.functional.gelu(before))


def test_rope_equals_hf_rotate_half_exactly():
    """The folded-sign rotation equals HF's ``x * cos + rotate_half(x) * sin`` (up to addcmul's FMA rounding)."""
    from transformers.models.qwen3.modeling_qwen3 import rotate_half

    torch.manual_seed(0)
    x, cos, sin = torch.randn(3, 4, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)  # x [N, heads, D]
    torch.testing.assert_close(rope(x, cos, sign_sin(sin)), x * cos + rotate_half(x) * sin, rtol=0, atol=1e-6)
    swapped_sign = rope(x, torch.zeros_like(cos), sign_sin(sin))  # rotate_half(x) * sin alone: exact
    assert torch.equal(swapped_sign, rotate_half(x) * sin)


@pytest.mark.parametrize("backend", ["int8", "fbgemm", "emulate"])
def test_residual_add_in_place_is_exact_and_leaves_the_stream_alone(backend):
    """QuantLinear outputs take the residual in place: bit-identical to ``x + linear(h)``, ``x`` untouched."""
    from ais_lightning.quant import QuantLinear

    torch.manual_seed(0)
    linear = QuantLinear.from_linear(torch.nn.Linear(16, 8), "int8", backend=backend)
    x, h = torch.randn(3, 8), torch.randn(3, 16)
    x_before = x.clone()
    with torch.inference_mode():
        out = linear_residual(x, h, linear)
        expected = x_before + linear(h)
    assert torch.equal(out, expected) and torch.equal(x, x_before) and out.data_ptr() != x.data_ptr()


def test_bf16_and_fp8_kv_cache_are_close_but_not_equal(model):
    sampling = SamplingConfig(n=2, max_new_tokens=8, seed=0)
    for kwargs in ({"precision": "bf16"}, {"kv_cache_dtype": "fp8"}):
        batch = TorchRolloutEngine(model, **kwargs).generate(PROMPTS, sampling)
        delta = (_policy_logprobs(model, batch, 1.0) - batch.rollout_logprobs)[batch.response_mask]
        assert 1e-6 < delta.abs().max().item() < 0.2, kwargs


def _sgd_step(model):
    """One plain SGD step on the log-likelihood of a fixed batch; returns the updated copy."""
    trained = copy.deepcopy(model).train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [40, 41, 42, 43, 44, 45]])
    loss = trained(input_ids=ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        for p in trained.parameters():
            p -= 5.0 * p.grad
    return trained.eval()


@pytest.mark.parametrize("precision", ["fp32", "fp8", "int8"])
def test_weight_sync_tracks_the_trainer(model, precision):
    kv = "fp8" if precision == "fp8" else None
    engine = TorchRolloutEngine(model, precision=precision, kv_cache_dtype=kv)
    sampling = SamplingConfig(n=2, max_new_tokens=8, seed=2)
    engine.generate(PROMPTS, sampling)
    trained = _sgd_step(model)
    engine.sync_weights(Policy(trained).full_state_dict())
    batch = engine.generate(PROMPTS, sampling)
    mask = batch.response_mask
    new_lp = _policy_logprobs(trained, batch, 1.0)
    old_lp = _policy_logprobs(model, batch, 1.0)
    assert (new_lp - old_lp)[mask].abs().max().item() > 1e-2  # the step changed the policy
    if precision == "fp32":
        assert (new_lp - batch.rollout_logprobs)[mask].abs().max().item() < 1e-5
    else:  # a synced quantized engine equals one freshly built from the new weights (KV scales, fused q/k/v)
        fresh = TorchRolloutEngine(trained, precision=precision, kv_cache_dtype=kv).generate(
            PROMPTS, sampling
        )
        assert torch.equal(fresh.response_ids, batch.response_ids)
        assert torch.allclose(fresh.rollout_logprobs, batch.rollout_logprobs, atol=1e-6)


def _state_with(model, name, value):
    """``model``'s full weights and buffers as a sync, with tensor ``name`` replaced by ``value``."""
    named = list(Policy(model).full_state_dict())
    assert name in dict(named)
    return [(n, value if n == name else t) for n, t in named]


def _with_nan(t, index=(0, 0)):
    t = t.clone()
    t[index] = float("nan")
    return t


@pytest.mark.parametrize("precision, kv", [("fp32", None), ("int8", None), ("fp8", "fp8")])
def test_rejected_sync_leaves_the_engine_exactly_as_before(model, precision, kv):
    """A sync with one NaN weight (or one wrong shape, or one unknown name) is rejected as a whole, before
    any weight is written: the engine generates exactly what it generated before (tokens and log-probs)."""
    engine = TorchRolloutEngine(model, precision=precision, kv_cache_dtype=kv)
    sampling = SamplingConfig(n=2, max_new_tokens=8, seed=4)
    before = engine.generate(PROMPTS, sampling)
    trained = _sgd_step(model)  # every other tensor of the rejected syncs is a real, different update
    name = "model.layers.1.mlp.down_proj.weight"  # a quantized layer late in the sync order
    w = dict(trained.named_parameters())[name]
    bad_syncs = {
        "non-finite": _state_with(trained, name, _with_nan(w, (3, 5))),
        "shape": _state_with(trained, name, w[:, :-1]),
        "not have": _state_with(trained, name, w) + [("model.layers.9.mlp.up_proj.weight", w)],
    }
    for match, named in bad_syncs.items():
        with pytest.raises(ValueError, match=match) as err:
            engine.sync_weights(named)
        assert ("layers.9" if match == "not have" else name) in str(err.value)
        after = engine.generate(PROMPTS, sampling)
        assert torch.equal(after.response_ids, before.response_ids), match
        assert torch.equal(after.rollout_logprobs, before.rollout_logprobs), match
    engine.sync_weights(Policy(trained).full_state_dict())  # the engine still takes a good sync
    synced = engine.generate(PROMPTS, sampling)
    fresh = TorchRolloutEngine(trained, precision=precision, kv_cache_dtype=kv).generate(PROMPTS, sampling)
    assert torch.equal(synced.response_ids, fresh.response_ids)
    assert torch.equal(synced.rollout_logprobs, fresh.rollout_logprobs)


def test_sync_checks_finiteness_after_the_cast_to_the_engine_dtype(model):
    """3.4e38 is a finite float32 but rounds to inf in bfloat16: a bf16 engine rejects it, fp32 takes it."""
    big = torch.full_like(model.model.norm.weight, 3.4e38)
    assert torch.isfinite(big).all() and not torch.isfinite(big.bfloat16()).any()
    named = [("model.norm.weight", big)]
    bf16 = TorchRolloutEngine(model, precision="bf16")
    before = bf16.model.model.norm.weight.clone()
    with pytest.raises(ValueError, match="model.norm.weight has 128 non-finite.*torch.bfloat16"):
        bf16.sync_weights(named)
    assert torch.equal(bf16.model.model.norm.weight, before)
    fp32 = TorchRolloutEngine(model)
    fp32.sync_weights(named)
    assert torch.equal(fp32.model.model.norm.weight, big)


def test_sync_rejects_unknown_names_and_leaves_weights(model):
    engine = TorchRolloutEngine(model)
    before = engine.model.lm_head.weight.clone()
    named = [
        ("lm_head.weight", torch.zeros_like(before)),
        ("not.a.weight", torch.zeros(1)),
        ("x.y", torch.zeros(1)),
    ]
    with pytest.raises(ValueError, match="not.a.weight.*x.y|x.y.*not.a.weight"):
        engine.sync_weights(named)
    assert torch.equal(engine.model.lm_head.weight, before)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"precision": "fp6"}, "^precision='fp6'.*one of \\['fp32', 'bf16', 'fp8', 'fp4', 'int8', "),
        ({"kv_cache_dtype": "int4"}, "^kv_cache_dtype='int4'.*one of \\[None, 'auto', 'fp8'\\]"),
        (
            {"precision": "fp32", "backend": "emulate"},
            "^backend='emulate' is only used by TorchRolloutEngine with precision in",
        ),
        (
            {"precision": "int8", "backend": "onednn"},
            "^backend='onednn'.*one of \\['emulate', 'int8', 'fbgemm', 'fp8_gemm'\\]",
        ),
        ({"precision": "fp8", "backend": "int8"}, "^backend='int8'.*must be 'emulate' or None"),
        ({"precision": "fp4", "backend": "fbgemm"}, "^backend='fbgemm'.*only runs precision='int8'"),
        ({"compact_below": 1.0}, "^compact_below must be in \\[0, 1\\)"),
        ({"compact_below": "0.5"}, "^compact_below must be a number"),
        ({"pad_token_id": -1}, "^pad_token_id must be None or an int >= 0"),
        ({"precision": "int8", "outlier_fraction": 1.0}, "^outlier_fraction must be a number in \\[0, 1\\)"),
        (
            {"precision": "int4_ocs", "outlier_fraction": 0.05},
            "^outlier_fraction=0.05 keeps outlier channels",
        ),
    ],
)
def test_bad_config_raises(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TorchRolloutEngine.check_args(**kwargs)  # config time: no model needed
    with pytest.raises(ValueError, match=match):
        TorchRolloutEngine(model, **kwargs)


def test_check_args_fills_the_constructor_defaults_and_normalizes(int8_isa):
    assert TorchRolloutEngine.check_args() == {
        "precision": "fp32",
        "kv_cache_dtype": None,
        "backend": None,
        "device": None,  # the device of the model the engine is given
        "pad_token_id": None,
        "compact_below": 0.5,
        "model_impl": "auto",
        "outlier_fraction": 0.0,  # nothing is quantized at fp32
        "head_dtype": None,  # the model dtype
    }
    args = TorchRolloutEngine.check_args(precision="fp4", kv_cache_dtype="auto")
    assert (args["backend"], args["kv_cache_dtype"], args["outlier_fraction"]) == ("emulate", None, 0.0)
    assert TorchRolloutEngine.check_args(precision="int8")["outlier_fraction"] == 0.1
    assert TorchRolloutEngine.check_args(precision="fp8", outlier_fraction=0)["outlier_fraction"] == 0.0
    # int8: the CPU's fastest exact integer GEMM, torch._int_mm with AVX512-VNNI, fbgemm's on other x86 CPUs
    expected = {"vnni": "int8", "avx2": "fbgemm"}[int8_isa]
    assert TorchRolloutEngine.check_args(precision="int8")["backend"] == expected
    with pytest.raises(ValueError, match="^max_model_len: not an argument of TorchRolloutEngine.*it accepts"):
        TorchRolloutEngine.check_args(max_model_len=64)


def test_constructor_uses_the_checked_arguments(model):
    engine = TorchRolloutEngine(model, precision="fp4", kv_cache_dtype="auto")
    assert (engine.precision, engine.backend, engine.kv_cache_dtype, engine.kv_scales) == (
        "fp4",
        "emulate",
        None,
        None,
    )
    assert TorchRolloutEngine(model, kv_cache_dtype="fp8").kv_scales is not None


def test_bad_prompts_raise(model):
    engine = TorchRolloutEngine(model)
    for prompts in ([], [[]], [[1, 2, 10_000]], [[-1]]):
        with pytest.raises(ValueError, match="prompts"):
            engine.generate(prompts, SamplingConfig())


def _input_ranges(model, prompts):
    """Per linear module name, ``max |x|`` per input channel over every real token of ``prompts`` (each run
    alone, unpadded, through the model's own fp32 forward): what the engine's calibration pass should see."""
    ranges, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lm_head" not in name:

            def hook(_, args, name=name):
                amax = args[0].reshape(-1, args[0].shape[-1]).abs().amax(0)
                ranges[name] = torch.maximum(ranges[name], amax) if name in ranges else amax

            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for p in prompts:
            model(input_ids=torch.tensor([p]))
    for h in hooks:
        h.remove()
    return ranges


def test_outlier_channels_are_calibrated_on_the_first_prompts_unquantized(model):
    from ais_lightning.quant import largest_channels, outlier_count

    engine = TorchRolloutEngine(model, precision="int8")
    assert engine.outlier_fraction == 0.1 and not engine.outliers.calibrated
    assert all(layer.outlier_channels is None for layer in engine.quantized)
    engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=4, seed=0))
    ranges = _input_ranges(model, PROMPTS)
    k = outlier_count(model.config.hidden_size, 0.1)  # ceil(0.1 * 128) = 13
    for i, layer in enumerate(engine.model.model.layers):
        qkv = engine.lean.qkv[i] if engine.lean.qkv[i] is not None else layer.self_attn.q_proj
        assert (
            qkv.outlier_channels.tolist()
            == largest_channels(ranges[f"model.layers.{i}.self_attn.q_proj"], k).tolist()
        )
        gate_up = engine.lean.gate_up[i]
        for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            module = (
                gate_up
                if gate_up is not None and name in ("mlp.gate_proj", "mlp.up_proj")
                else layer.get_submodule(name)
            )
            want = largest_channels(
                ranges[f"model.layers.{i}.{name}"], outlier_count(module.in_features, 0.1)
            )
            assert module.outlier_channels.tolist() == want.tolist(), name
    assert engine.outliers.calibrated
    assert all(
        m.outlier_channels is None
        for m in TorchRolloutEngine(model, precision="int8", outlier_fraction=0).quantized
    )


def test_outlier_channels_recover_an_injected_outlier_feature(model):
    """A function-preserving outlier feature, as real LLMs have: one channel of every input norm's weight x 200
    and the q/k/v and gate/up columns it feeds / 200. fp32 is unchanged; per-token int8 loses every other channel
    of the token to the outlier's step, and keeping 5% of the channels in fp32 gives the precision back."""
    outlier = copy.deepcopy(model)
    with torch.no_grad():
        for layer in outlier.model.layers:
            for norm, linears in (
                (
                    layer.input_layernorm,
                    [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                ),
                (layer.post_attention_layernorm, [layer.mlp.gate_proj, layer.mlp.up_proj]),
            ):
                norm.weight[17] *= 200.0
                for linear in linears:
                    linear.weight[:, 17] /= 200.0
    prompts = [[i, i + 1, i + 2] for i in range(3, 60, 4)]
    sampling = SamplingConfig(n=4, max_new_tokens=16, seed=0)
    assert _k3(outlier, TorchRolloutEngine(outlier).generate(prompts, sampling)) < 1e-9  # fp32: same function
    plain = _k3(
        outlier, TorchRolloutEngine(outlier, precision="int8", outlier_fraction=0).generate(prompts, sampling)
    )
    kept = _k3(outlier, TorchRolloutEngine(outlier, precision="int8").generate(prompts, sampling))
    baseline = _k3(
        model, TorchRolloutEngine(model, precision="int8", outlier_fraction=0).generate(prompts, sampling)
    )
    assert plain > 20 * baseline, (plain, baseline)  # the outlier broke per-token int8
    assert kept < 2 * baseline, (kept, baseline)  # and the kept channel repairs it


def test_set_precision_recalibrates_outlier_channels_at_the_new_precision(model):
    engine = TorchRolloutEngine(model, precision="fp8", backend="emulate")
    engine.generate(PROMPTS, SamplingConfig(max_new_tokens=2, seed=0))
    assert all(m.outlier_channels is not None for m in engine.quantized)
    engine.set_precision("int4")  # default 0 at int4 (and int4_ocs splits outliers itself)
    assert engine.outlier_fraction == 0 and engine.outliers is None
    assert all(m.outlier_channels is None for m in engine.quantized)
    engine.set_precision("fp8")
    assert engine.outlier_fraction == 0.05 and not engine.outliers.calibrated
