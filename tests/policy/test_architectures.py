"""Policy on causal LMs of many families: its log-probs are the model's own, its dropout is off."""

import pytest
import torch
import transformers as T

from ais_lightning.policy import Policy, disable_dropout_in
from tests.architectures import ARCHITECTURES, build

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

# Three left-padded prompts, right-padded responses (the second row's last two tokens are padding).
PROMPT_IDS = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 0, 0, 11]])
RESPONSE_IDS = torch.tensor([[12, 13, 14], [15, 16, 0], [17, 18, 19]])


def _batch():
    return PROMPT_IDS, PROMPT_IDS != 0, RESPONSE_IDS, torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 1]]).bool()


def _reference(model, temperature):
    """Log-probs and entropies from ``model(...).logits`` of each row run alone, without padding."""
    prompt_ids, prompt_mask, response_ids, response_mask = _batch()
    logprobs = torch.zeros(response_ids.shape)
    entropy = torch.zeros(response_ids.shape)
    with torch.no_grad():
        for row in range(len(prompt_ids)):
            prompt = prompt_ids[row][prompt_mask[row]]
            response = response_ids[row][response_mask[row]]
            ids = torch.cat([prompt, response])[None]
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [T, V]
            logp = (logits.double() / temperature).log_softmax(-1)
            logprobs[row, : len(response)] = logp.gather(-1, response[:, None]).squeeze(-1).float()
            entropy[row, : len(response)] = -(logp.exp() * logp).sum(-1).float()
    return logprobs, entropy


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_logprobs_and_entropy_are_the_model_forward(name):
    """Logit transforms, sliding windows, Conv1D, experts: every row scored as the model scores it alone."""
    model = build(name)
    out = Policy(model).response_logprobs(*_batch(), temperature=0.7, compute_entropy=True)
    ref_lp, ref_ent = _reference(model, 0.7)
    mask = _batch()[3]
    torch.testing.assert_close(out.logprobs[mask], ref_lp[mask], atol=2e-5, rtol=0)
    torch.testing.assert_close(out.entropy[mask], ref_ent[mask], atol=2e-5, rtol=0)
    assert (out.logprobs[~mask] == 0).all()


class _TripledLogits(T.LlamaForCausalLM):
    """A causal LM whose forward does something to its logits that no config names."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3
        return out


def test_a_head_it_cannot_reproduce_is_refused():
    cls, kwargs = ARCHITECTURES["llama"]
    model = _TripledLogits(cls(**kwargs))
    with pytest.raises(ValueError, match="_TripledLogits's forward computes its logits differently"):
        Policy(model)


def test_dropout_is_off_by_default_and_log_probs_are_deterministic():
    cls, kwargs = ARCHITECTURES["gpt2"]
    model = build("gpt2")
    fresh = T.AutoModelForCausalLM.from_config(cls(**kwargs)).train()  # GPT-2's default dropout is 0.1
    assert fresh.config.resid_pdrop == 0.1

    noisy = Policy(fresh, disable_dropout=False).train()
    a, b = (noisy.response_logprobs(*_batch()).logprobs for _ in range(2))
    assert not torch.equal(a, b), "with dropout, two passes over the same batch differ"

    policy = Policy(model.train())
    a, b = (policy.response_logprobs(*_batch()).logprobs for _ in range(2))
    assert torch.equal(a, b)
    assert disable_dropout_in(fresh) > 0 and disable_dropout_in(fresh) == 0  # counted once, then nothing left
    a, b = (noisy.response_logprobs(*_batch()).logprobs for _ in range(2))
    assert torch.equal(a, b)


def test_float_dropout_attributes_and_the_config_are_zeroed():
    """GPTBigCode's attention reads a float ``attn_dropout``; some attention functions read the config's."""
    config = T.GPTBigCodeConfig(vocab_size=64, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.3)
    model = T.AutoModelForCausalLM.from_config(config)
    assert {m.attn_dropout for m in model.modules() if hasattr(m, "attn_dropout")} == {0.3}
    policy = Policy(model)
    assert {m.attn_dropout for m in model.modules() if hasattr(m, "attn_dropout")} == {0.0}
    assert model.config.attn_pdrop == 0.0 and policy.model.training
    a, b = (policy.response_logprobs(*_batch()).logprobs for _ in range(2))
    assert torch.equal(a, b)


def test_float_attention_dropout_is_zeroed():
    cls, kwargs = ARCHITECTURES["llama"]
    model = T.AutoModelForCausalLM.from_config(cls(**{**kwargs, "attention_dropout": 0.5}))
    assert {m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")} == {0.5}
    assert disable_dropout_in(model) == kwargs["num_hidden_layers"] + 1  # each layer's, and the config's
    assert {m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")} == {0.0}
