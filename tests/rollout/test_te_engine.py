"""Transformer Engine rollouts: config-time checks (CPU, on a pretend GPU), the scale-1.0 failure they guard
against (CPU emulation), and FP8 log-probs against fp32 where CUDA and TE exist."""

import copy
import importlib.util

import pytest
import torch

from ais_lightning.models import build_tiny_qwen3
from ais_lightning.policy import Policy
from ais_lightning.quant import quantize_model
from ais_lightning.rollout import SamplingConfig, TERolloutEngine, engine_args
from ais_lightning.rollout.te_engine import TE_RECIPE_REQUIREMENTS
from ais_lightning.toolkit.realistic import (
    FP8_LOGPROB_TOLERANCE,
    mean_abs_logprob_delta,
    realistic_tiny_qwen3,
    scale_one_fp8,
)
from tests.gpu.fake_cuda import fake_cuda

HAS_CUDA = torch.cuda.is_available()
HAS_TE = importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA error")
def test_without_cuda_construction_raises_clear_error():
    with pytest.raises(ValueError, match="needs a CUDA GPU.*TorchRolloutEngine"):
        TERolloutEngine(build_tiny_qwen3(seed=0))
    with pytest.raises(ValueError, match="needs a CUDA GPU"):  # the same check, with no model
        TERolloutEngine.check_args()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"precision": "fp4"}, "^precision='fp4'.*one of \\['fp8'\\]"),
        ({"recipe": "delayed"}, "^recipe='delayed'.*one of \\['current', 'block', 'mxfp8'\\]"),
        ({"fp8_format": "E5M2"}, "^fp8_format='E5M2'.*one of \\['E4M3', 'HYBRID'\\]"),
        ({"params_dtype": "int8"}, "^params_dtype"),
        ({"device": "cpu"}, "^device must be None or a CUDA device"),
        ({"kv_cache_dtype": "int4"}, "^kv_cache_dtype"),
        ({"compact_below": 1.5}, "^compact_below"),
    ],
)
def test_bad_options_raise_before_touching_the_device(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TERolloutEngine.check_args(**kwargs)
    with pytest.raises(ValueError, match=match):  # the constructor runs the same check first
        TERolloutEngine(build_tiny_qwen3(seed=0), **kwargs)


def test_config_time_check_rejects_options_of_other_engines():
    with pytest.raises(ValueError, match="unknown argument.*'backend'.*accepts.*'fp8_format'"):
        TERolloutEngine.check_args(backend="int8")
    with pytest.raises(ValueError, match="amax_history_len.*unknown argument"):  # DelayedScaling is gone
        TERolloutEngine.check_args(amax_history_len=16)


def _installed(monkeypatch, version=(2, 20, 0)):
    monkeypatch.setattr(engine_args, "has_package", lambda name: True)
    monkeypatch.setattr(engine_args, "package_version", lambda dist: version)


def test_check_args_fills_the_constructor_defaults(monkeypatch):
    _installed(monkeypatch)
    fake_cuda(monkeypatch, capability=(8, 9), current=1)
    args = TERolloutEngine.check_args(params_dtype="float16", kv_cache_dtype="auto")
    assert args == {
        "precision": "fp8",
        "kv_cache_dtype": None,
        "recipe": "current",
        "fp8_format": "E4M3",
        "params_dtype": torch.float16,
        "device": "cuda:1",  # None: the current device, each rank's own GPU under Lightning
        "pad_token_id": None,
        "compact_below": 0.5,
    }
    assert TERolloutEngine.check_args(device="cuda:0")["device"] == "cuda:0"
    with pytest.raises(ValueError, match="device='cuda:2'.*2 CUDA device"):
        TERolloutEngine.check_args(device="cuda:2")


@pytest.mark.parametrize(
    "recipe, capability, cuda, match",
    [
        ("current", (8, 6), "12.9", r"recipe='current'.*compute capability >= 8\.9.*has 8\.6"),
        ("block", (8, 9), "12.9", r"recipe='block'.*compute capability >= 9\.0.*has 8\.9"),
        ("block", (9, 0), "12.4", r"recipe='block'.*needs CUDA >= 12\.9.*12\.4"),
        ("mxfp8", (9, 0), "12.9", r"recipe='mxfp8'.*>= 10\.0 and < 12\.0.*has 9\.0"),
        ("mxfp8", (12, 0), "12.9", r"recipe='mxfp8'.*>= 10\.0 and < 12\.0.*has 12\.0"),
        ("current", (8, 9), "12.1", None),
        ("block", (10, 0), "12.9", None),
        ("mxfp8", (10, 0), "12.8", None),
    ],
)
def test_each_recipe_names_its_hardware_requirement(monkeypatch, recipe, capability, cuda, match):
    _installed(monkeypatch)
    fake_cuda(monkeypatch, capability=capability, cuda_version=cuda)
    if match is None:
        assert TERolloutEngine.check_args(recipe=recipe)["recipe"] == recipe
    else:
        with pytest.raises(ValueError, match=match):
            TERolloutEngine.check_args(recipe=recipe)
    assert set(TE_RECIPE_REQUIREMENTS) == {"current", "block", "mxfp8"}


@pytest.mark.parametrize("version", [(2, 7, 0), (2, 8, 0)])
def test_old_transformer_engine_is_named(monkeypatch, version):
    """TE 2.8 has only ``fp8_autocast``; ``te.autocast``, which the engine calls, first ships in 2.9."""
    _installed(monkeypatch, version=version)
    fake_cuda(monkeypatch, capability=(9, 0))
    found = ".".join(map(str, version)).replace(".", r"\.")
    with pytest.raises(ValueError, match=rf"Transformer Engine \(te.autocast\) >= 2\.9, found .* {found}"):
        TERolloutEngine.check_args()
    _installed(monkeypatch, version=(2, 9, 0))
    assert TERolloutEngine.check_args()["recipe"] == "current"


def _te_stand_in(monkeypatch, api_of_2_8: bool):
    """A stand-in ``transformer_engine.pytorch``: 2.8's API (``fp8_autocast`` only) or 2.9's (``autocast``)."""
    import contextlib
    import sys
    import types

    te = types.ModuleType("transformer_engine.pytorch")
    te.fp8_autocast = lambda **kwargs: contextlib.nullcontext()
    if not api_of_2_8:
        te.autocast = lambda **kwargs: contextlib.nullcontext()
    package = types.ModuleType("transformer_engine")
    package.pytorch = te
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te)
    return te


def test_transformer_engine_with_the_api_of_2_8_is_refused_on_import(monkeypatch):
    """Whatever its metadata says (a source build, a renamed distribution), a TE without ``te.autocast`` is
    refused when the engine imports it, naming the version, not at the first generate (AttributeError)."""
    from ais_lightning.rollout.te_engine import import_transformer_engine

    _te_stand_in(monkeypatch, api_of_2_8=True)
    with pytest.raises(ImportError, match=r"Transformer Engine >= 2\.9.*te\.autocast.*fp8_autocast"):
        import_transformer_engine()
    te = _te_stand_in(monkeypatch, api_of_2_8=False)
    assert import_transformer_engine() is te


def _sampled_batch(model, seed=0, batch=32, prompt_len=6, new=16):
    """Prompts and responses sampled from ``model`` in fp32 (the tokens a rollout would score)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 99, (batch, prompt_len), generator=gen)
    ids = prompts
    with torch.no_grad():
        for _ in range(new):
            probs = model(ids).logits[:, -1].softmax(-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    mask = torch.ones(batch, new, dtype=torch.bool)
    return prompts, torch.ones_like(prompts, dtype=torch.bool), ids[:, prompt_len:], mask


@torch.no_grad()
def _logprobs(model, batch):
    return Policy(model).response_logprobs(*batch).logprobs


def test_scales_of_one_break_a_realistic_model_that_per_tensor_scaling_keeps():
    """What the GPU test below guards against, shown on CPU by emulation: with every FP8 scale at 1.0
    (TE's DelayedScaling under inference_mode) the log-probs leave the tolerance; with scales computed
    from each tensor (Float8CurrentScaling's numerics, and the blockwise fp8 recipe) they stay inside."""
    model = realistic_tiny_qwen3()
    batch = _sampled_batch(model)
    ref = _logprobs(model, batch)
    mask = batch[3]
    assert 0.3 < float(-ref[mask].mean()) < 3.0  # peaked, not near-uniform (log 99 = 4.6)
    broken = mean_abs_logprob_delta(ref, _logprobs(scale_one_fp8(model), batch), mask)
    current = mean_abs_logprob_delta(
        ref, _logprobs(quantize_model(copy.deepcopy(model), "fp8_tensor"), batch), mask
    )
    block = mean_abs_logprob_delta(ref, _logprobs(quantize_model(copy.deepcopy(model), "fp8"), batch), mask)
    print(
        f"mean |delta log p| vs fp32: scale 1.0 {broken:.3f}, per-tensor {current:.3f}, blockwise {block:.3f}"
    )
    # Measured: scale 1.0 0.64, per-tensor 0.074, blockwise 0.071 (512 tokens).
    assert broken > 1.5 * FP8_LOGPROB_TOLERANCE
    assert current < FP8_LOGPROB_TOLERANCE / 2
    assert block < FP8_LOGPROB_TOLERANCE / 2


def _te_recipes_here() -> list[str]:
    if not (HAS_CUDA and HAS_TE):
        return ["current"]
    cap = torch.cuda.get_device_capability()
    recipes = ["current"]
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    if cap >= (9, 0) and cuda >= (12, 9):
        recipes.append("block")
    if (10, 0) <= cap < (12, 0):
        recipes.append("mxfp8")
    return recipes


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TE), reason="needs CUDA and transformer_engine")
@pytest.mark.parametrize("recipe", _te_recipes_here())
def test_te_fp8_logprobs_match_fp32_on_a_realistic_model(recipe):
    """Rollout log-probs of the TE engine (fp32 params, so FP8 is the only difference) against the fp32
    policy on the tokens it sampled; with scales stuck at 1.0 the mean |delta| would be ~0.64 (the CPU test
    above), over the tolerance."""
    model = realistic_tiny_qwen3()
    engine = TERolloutEngine(model, recipe=recipe, params_dtype="float32")
    assert engine.num_te_linears == 4 * 7  # q, k, v, o, gate, up, down per layer; lm_head kept
    prompts = [
        [int(t) for t in torch.randint(3, 99, (6,), generator=torch.Generator().manual_seed(i))]
        for i in range(16)
    ]
    batch = engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=16, seed=0))
    with torch.no_grad():
        pi = (
            Policy(model)
            .response_logprobs(
                batch.prompt_ids.cpu(),
                batch.prompt_mask.cpu(),
                batch.response_ids.cpu(),
                batch.response_mask.cpu(),
            )
            .logprobs
        )
    mask = batch.response_mask.cpu()
    delta = mean_abs_logprob_delta(pi, batch.rollout_logprobs.cpu(), mask)
    print(f"TE {recipe}: mean |delta log p| vs fp32 = {delta:.4f} over {int(mask.sum())} tokens")
    assert torch.isfinite(batch.rollout_logprobs).all()
    assert 0 < delta < FP8_LOGPROB_TOLERANCE

    # A weight sync changes what the engine computes (TE re-quantizes every forward: nothing stale).
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    engine.sync_weights(list(changed.state_dict().items()))
    again = engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=16, seed=0))
    with torch.no_grad():
        pi_new = (
            Policy(changed)
            .response_logprobs(
                again.prompt_ids.cpu(),
                again.prompt_mask.cpu(),
                again.response_ids.cpu(),
                again.response_mask.cpu(),
            )
            .logprobs
        )
    assert mean_abs_logprob_delta(pi_new, again.rollout_logprobs.cpu(), again.response_mask.cpu()) < (
        FP8_LOGPROB_TOLERANCE
    )


def test_every_recipe_accumulates_the_forward_gemm_in_fp32(monkeypatch):
    """TE's ``Float8CurrentScaling`` defaults to ``fp8_gemm_fprop = MMParams(use_split_accumulator=False)``:
    Hopper's fast FP8 accumulation, which keeps fewer bits of the running sum than the emulation and the
    ``fp8_gemm`` backend (FP32). The engine's recipes all ask for the split (FP32) accumulator; TE's linear reads
    ``recipe.fp8_gemm_fprop`` when the recipe has it (MXFP8's has not: set too). A stand-in of TE's recipe module
    with TE 2.9's defaults (``ais_lightning.toolkit.stand_ins.te_recipes``)."""
    import sys

    from ais_lightning.rollout.te_engine import make_te_recipe
    from ais_lightning.toolkit.stand_ins.te_recipes import te_recipe_modules

    modules = te_recipe_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    recipes = modules["transformer_engine.common.recipe"]
    assert recipes.Float8CurrentScaling().fp8_gemm_fprop.use_split_accumulator is False  # TE's default
    for recipe in ("current", "block", "mxfp8"):
        built = make_te_recipe(recipe, "E4M3")
        assert built.fp8_gemm_fprop.use_split_accumulator is True, recipe
        assert built.fp8_format is recipes.Format.E4M3
    block = make_te_recipe("block", "E4M3")
    assert not block.fp8_quant_fwd_inp.power_2_scale and not block.fp8_quant_fwd_weight.power_2_scale


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TE), reason="needs CUDA and transformer_engine")
def test_te_current_scaling_gemm_accumulates_as_the_emulation_on_gpu():
    """One TE linear (fp32 parameters: FP8 operands, FP32 output) under the engine's ``current`` recipe against the
    emulated per-tensor FP8 recipe (the same quantized operands multiplied in fp32) at K = 4096. With FP32
    accumulation only the summation order differs (relative error ~1e-6); Hopper's fast FP8 accumulation
    (TE's default for this recipe) loses up to ~2% at this K (DeepSeek-V3, arXiv 2412.19437 section 3.3.2),
    far over the bound."""
    import transformer_engine.pytorch as te

    from ais_lightning.quant import QuantLinear
    from ais_lightning.rollout.te_engine import make_te_recipe

    torch.manual_seed(0)
    k, n = 4096, 256
    linear = te.Linear(k, n, bias=False, params_dtype=torch.float32, device="cuda")
    with torch.no_grad():
        linear.weight.normal_(0, 0.02)
    x = torch.randn(64, k, device="cuda")
    with torch.no_grad(), te.autocast(enabled=True, recipe=make_te_recipe("current", "E4M3")):
        real = linear(x)
    reference = torch.nn.Linear(k, n, bias=False, device="cuda")
    with torch.no_grad():
        reference.weight.copy_(linear.weight)
        emulated = QuantLinear.from_linear(reference, "fp8_tensor", backend="emulate")(x)
    relative = float((real.float() - emulated).abs().max() / emulated.abs().max())
    print(f"TE current scaling vs emulated fp8_tensor at K={k}: max relative error {relative:.2e}")
    assert relative < 1e-3
