"""The built-in tiny Qwen3: size, determinism, offline save/load."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3, save_tiny_model, tiny_qwen3_config


def test_config_fields():
    cfg = tiny_qwen3_config(vocab_size=len(build_char_tokenizer()))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        128,
        4,
        4,
        2,
    )
    assert (cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings) == (32, 384, 512)
    assert cfg.tie_word_embeddings
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2)
    assert cfg._attn_implementation == "eager"
    assert tiny_qwen3_config(num_hidden_layers=2).num_hidden_layers == 2


def test_config_rejects_bad_options():
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_qwen3_config(vocab_size=10)
    with pytest.raises(ValueError, match="attn_implementation"):
        tiny_qwen3_config(attn_implementation="flash_attention_2")


def test_param_count_and_forward_shape():
    model = build_tiny_qwen3()
    assert isinstance(model, Qwen3ForCausalLM)
    # Hand count: embedding 99*128 (tied with lm_head); per layer q,o 128*128, k,v 128*64,
    # q_norm/k_norm 32 each, MLP 3*128*384, two RMSNorms 128 each; final norm 128.
    per_layer = 2 * 128 * 128 + 2 * 128 * 64 + 2 * 32 + 3 * 128 * 384 + 2 * 128
    assert sum(p.numel() for p in model.parameters()) == 99 * 128 + 4 * per_layer + 128 == 800_512
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(3, 99, (2, 7))
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (2, 7, 99)


def test_seed_determinism_without_touching_global_rng():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build_tiny_qwen3(seed=0), build_tiny_qwen3(seed=0), build_tiny_qwen3(seed=1)
    assert torch.rand(1) == expected_next
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


def test_save_load_round_trip_same_logits(tmp_path):
    model, tok = build_tiny_qwen3(seed=3), build_char_tokenizer()
    path = save_tiny_model(model, tok, tmp_path / "tiny")
    loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation="eager")
    loaded_tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert loaded.config.eos_token_id == loaded_tok.eos_token_id == 2
    ids = torch.tensor([loaded_tok.encode("12+34=46\n")])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
