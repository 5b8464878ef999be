"""The tiny masked-diffusion LM and its tokenizer: ids, determinism, bidirectional attention, padding."""

from __future__ import annotations

import pytest
import torch

from ais_lightning.models import (
    MASK_TOKEN_ID,
    TinyDiffusionLM,
    build_char_tokenizer,
    build_diffusion_tokenizer,
    build_tiny_diffusion,
    tiny_diffusion_config,
)
from ais_lightning.models.tiny_diffusion import SUPPRESSED_LOGIT
from ais_lightning.quant import QuantLinear, quantize_model


def test_tokenizer_adds_mask_without_moving_ids():
    char, tok = build_char_tokenizer(), build_diffusion_tokenizer()
    assert (tok.mask_token_id, len(tok), MASK_TOKEN_ID) == (99, 100, 99)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "12+34=46\n~ !"
    assert tok.encode(text, add_special_tokens=False) == char.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.convert_ids_to_tokens(99) == "<mask>"
    assert tok.decode([20, 99, 21, 2], skip_special_tokens=True) == "12"


def test_config_and_size():
    model = build_tiny_diffusion(seed=0)
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (
        100,
        128,
        4,
        4,
    )
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (2, 32, 384)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id, cfg.mask_token_id) == (0, 1, 2, 99)
    # 100*128 embedding (tied head) + 4 blocks * (attention 128*(128+64+64) + 128*128, MLP 3*128*384, norms)
    per_block = 128 * 256 + 128 * 128 + 3 * 128 * 384 + 2 * 128 + 2 * 32
    assert model.num_parameters() == 100 * 128 + 4 * per_block + 128
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert cfg.to_dict()["mask_token_id"] == 99


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"vocab_size": 50}, "vocab_size"),
        ({"num_attention_heads": 3}, "multiple"),
        ({"mask_token_id": 2}, "mask_token_id"),
        ({"mask_token_id": 100}, "mask_token_id"),
        ({"head_dim": 31}, "even"),
        ({"hidden": 3}, "unknown"),
    ],
)
def test_config_rejects_bad_options(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_diffusion_config(**overrides)


def test_deterministic_in_seed_and_leaves_global_rng():
    state = torch.random.get_rng_state()
    a, b, c = build_tiny_diffusion(seed=3), build_tiny_diffusion(seed=3), build_tiny_diffusion(seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])


def test_attention_is_bidirectional():
    """Changing the LAST token changes the logits at the FIRST position (a causal model could not)."""
    model = build_tiny_diffusion(seed=0)
    x = torch.tensor([[5, 6, 7, 99, 99]])
    y = x.clone()
    y[0, -1] = 8
    with torch.no_grad():
        assert (model(x)[0, 0] - model(y)[0, 0]).abs().max() > 1e-4


def test_left_padding_is_invisible():
    """A left-padded row gives the logits of the row alone (pad keys are masked, positions count real
    tokens): the layout every engine and the policy rely on."""
    model = build_tiny_diffusion(seed=0)
    row = torch.tensor([[11, 12, 13, 99, 99, 20]])
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), row], dim=1)
    batch = torch.cat([padded, torch.tensor([[7, 8, 9, 10, 11, 12, 99, 99, 2]])])
    with torch.no_grad():
        alone = model(row)
        together = model(batch, attention_mask=batch != 0)
    torch.testing.assert_close(together[0, 3:], alone[0], rtol=0, atol=1e-5)


def test_mask_token_is_never_predicted():
    model = build_tiny_diffusion(seed=0)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 99, 99]]))
    assert torch.all(logits[..., MASK_TOKEN_ID] == SUPPRESSED_LOGIT)
    assert torch.all(logits.log_softmax(-1)[..., MASK_TOKEN_ID].exp() == 0)
    assert torch.isfinite(logits.log_softmax(-1)).all()


def test_quantize_model_covers_the_block_linears_only():
    model = build_tiny_diffusion(seed=0)
    quantize_model(model, "int8", backend="emulate")
    quantized = sorted(n for n, m in model.named_modules() if isinstance(m, QuantLinear))
    assert len(quantized) == 4 * 7  # q, k, v, o, gate, up, down per block
    assert not any("lm_head" in n or "embed" in n for n in quantized)
    assert isinstance(model, TinyDiffusionLM)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 99, 2]]))).all()
