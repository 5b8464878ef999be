"""TorchRolloutEngine on causal LMs of many families: the lean forward where it is exact, the model's own
forward everywhere else, and never a silently different distribution."""

import pytest
import torch

from ais_lightning.policy import Policy
from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine
from ais_lightning.rollout.prompts import left_pad
from tests.architectures import ARCHITECTURES, LEAN, build

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

# Prompts of different lengths; with max_new_tokens=8 the longest row runs past the sliding windows (3).
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [40, 41, 42]]
STOPS = [1, 3, 4, 20, 21, 22, 23, 24]


def _policy_logprobs(model, batch, temperature):
    with torch.no_grad():
        return (
            Policy(model)
            .response_logprobs(
                batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, temperature
            )
            .logprobs
        )


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_fp32_logprobs_match_the_policy(name):
    """Rows stop at different steps and finished rows are dropped from the cache (compact_below=0.9)."""
    model = build(name)
    engine = TorchRolloutEngine(model, precision="fp32", compact_below=0.9)
    assert engine.model_impl == ("lean" if name in LEAN else "transformers")
    batch = engine.generate(
        PROMPTS, SamplingConfig(n=3, temperature=0.8, max_new_tokens=8, stop_token_ids=STOPS, seed=0)
    )
    lengths = batch.response_mask.sum(-1)
    assert lengths.min() < lengths.max(), "rows should finish at different steps"
    diff = _policy_logprobs(model, batch, 0.8) - batch.rollout_logprobs
    assert diff[batch.response_mask].abs().max().item() < 1e-5
    assert (batch.rollout_logprobs[~batch.response_mask] == 0).all()


@pytest.mark.parametrize("name", ["mistral_sliding", "gemma2", "gpt2"])
def test_greedy_matches_hf_generate(name):
    model = build(name)
    batch = TorchRolloutEngine(model).generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=8))
    ids, mask = left_pad(PROMPTS, 0)
    model.generation_config.eos_token_id = None  # no stop token in either: 8 greedy tokens per row
    with torch.no_grad():
        ref = model.generate(
            input_ids=ids, attention_mask=mask.long(), do_sample=False, max_new_tokens=8, pad_token_id=0
        )
    assert torch.equal(batch.response_ids, ref[:, ids.shape[1] :])


def test_the_model_forward_equals_the_lean_forward_where_both_run():
    model = build("qwen3")
    sampling = SamplingConfig(n=2, max_new_tokens=8, stop_token_ids=STOPS, seed=5)
    lean = TorchRolloutEngine(model).generate(PROMPTS, sampling)
    hf = TorchRolloutEngine(model, model_impl="transformers").generate(PROMPTS, sampling)
    assert torch.equal(lean.response_ids, hf.response_ids)
    torch.testing.assert_close(lean.rollout_logprobs, hf.rollout_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "name, reason",
    [
        ("mistral_sliding", "sliding_window=3"),
        ("gemma2", "model_type 'gemma2' is not one it implements"),
        ("gpt2", "model_type 'gpt2' is not one it implements"),
    ],
)
def test_insisting_on_the_lean_forward_says_why_it_cannot(name, reason):
    with pytest.raises(ValueError, match=f"model_impl='lean'.*{reason}"):
        TorchRolloutEngine(build(name), model_impl="lean")


def test_an_fp8_kv_cache_needs_the_lean_forward():
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'.*lean forward cannot run Gemma2ForCausalLM"):
        TorchRolloutEngine(build("gemma2"), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs the lean forward"):
        TorchRolloutEngine.check_args(model_impl="transformers", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="model_impl"):
        TorchRolloutEngine.check_args(model_impl="vllm")


@pytest.mark.parametrize("precision", ["fp32", "int8", "fp4"])
def test_weight_sync_on_the_model_forward(precision):
    """Granite runs the model's forward: a sync lands in it (and re-quantizes), like a freshly built engine."""
    model = build("granite")
    engine = TorchRolloutEngine(model, precision=precision)
    assert engine.model_impl == "transformers" and (precision == "fp32") == (not engine.quantized)
    sampling = SamplingConfig(n=2, max_new_tokens=8, seed=2)
    trained = build("granite", seed=1)  # other weights, same names
    engine.sync_weights(Policy(trained).full_state_dict())
    batch = engine.generate(PROMPTS, sampling)
    new_lp = _policy_logprobs(trained, batch, 1.0)
    old_lp = _policy_logprobs(model, batch, 1.0)
    mask = batch.response_mask
    assert (new_lp - old_lp)[mask].abs().max().item() > 1e-1
    if precision == "fp32":
        assert (new_lp - batch.rollout_logprobs)[mask].abs().max().item() < 1e-5
    else:  # quantized: the mismatch is there, and the synced engine is one built from the new weights
        delta = (new_lp - batch.rollout_logprobs)[mask]
        assert delta.abs().max().item() > 1e-4
        fresh = TorchRolloutEngine(trained, precision=precision).generate(PROMPTS, sampling)
        assert torch.equal(fresh.response_ids, batch.response_ids)
        torch.testing.assert_close(fresh.rollout_logprobs, batch.rollout_logprobs, atol=1e-6, rtol=0)


def test_what_keeps_a_lean_family_off_the_lean_forward():
    from ais_lightning.rollout.torch_model import lean_unsupported

    assert lean_unsupported(build("qwen3")) is None
    qwen2 = build("qwen2")
    qwen2.config.layer_types = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    assert "layer_types 'sliding_attention' in layer 1" in lean_unsupported(qwen2)
    llama = build("llama")
    llama.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "RoPE type 'dynamic' depends on the sequence length" in lean_unsupported(llama)
    llama = build("llama")
    llama.config.logits_scaling = 4.0
    assert "transforms the logits" in lean_unsupported(llama)
    stripped = build("llama")
    del stripped.model.rotary_emb
    assert "model.model.{embed_tokens, layers, norm, rotary_emb}" in lean_unsupported(stripped)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gpt2", "qwen3_moe"])
def test_fp32_logprobs_match_the_policy_on_cuda(name):
    """The same parity on a GPU (fp32; torch leaves TF32 matmuls off by default): the lean path and the
    model's own forward with CUDA kernels."""
    model = build(name).cuda()
    engine = TorchRolloutEngine(model, precision="fp32", compact_below=0.9)
    assert engine.device.type == "cuda" and engine.model_impl == ("lean" if name in LEAN else "transformers")
    batch = engine.generate(
        PROMPTS, SamplingConfig(n=3, temperature=0.8, max_new_tokens=8, stop_token_ids=STOPS, seed=0)
    )
    diff = _policy_logprobs(model, batch, 0.8) - batch.rollout_logprobs
    assert diff[batch.response_mask].abs().max().item() < 1e-4
    rows = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    with torch.no_grad():  # the same weights on the CPU score the GPU's samples alike
        cpu_lp = Policy(build(name)).response_logprobs(*(t.cpu() for t in rows), temperature=0.8).logprobs
    assert (cpu_lp - batch.rollout_logprobs.cpu())[batch.response_mask.cpu()].abs().max().item() < 1e-4


def test_a_state_space_model_is_refused_with_the_measured_difference():
    """Mamba's forward reads the attention mask as a per-token gate, which cached decoding cannot give it:
    the probe measures the difference and the engine refuses rather than report another distribution."""
    import transformers as T

    from ais_lightning.rollout.decoders import cached_decode_mismatch

    config = T.MambaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, pad_token_id=0, eos_token_id=1)
    mamba = T.AutoModelForCausalLM.from_config(config)
    assert cached_decode_mismatch(mamba) > 0.1
    assert cached_decode_mismatch(build("gpt2")) < 1e-5 and cached_decode_mismatch(build("gemma2")) < 1e-5
    with pytest.raises(ValueError, match=r"cannot run MambaForCausalLM through its own forward: .* nats"):
        TorchRolloutEngine(mamba)
