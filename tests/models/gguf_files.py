"""A tiny Llama GGUF file written with the ``gguf`` package (what llama.cpp's converter writes, in small)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "Ġ 1"]


def write_tiny_llama_gguf(path: str | Path, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads) with a byte-level BPE tokenizer and a chat template.

    The embedding and the value projections are Q8_0, the other matrices Q4_1 (SmolLM2's file mixes the same
    two), norms F32; tied embeddings (no ``output.weight``), as SmolLM2.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIAL_TOKENS + list(bytes_to_unicode().values()) + merged
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))  # 3 control, 1 normal
    vocab, hidden, inter, layers, heads, kv_heads = len(tokens), 64, 128, 2, 4, 2
    head_dim = hidden // heads

    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def tensor(name: str, *shape: int, qtype: Q | None = None, scale: float = 0.2) -> None:
        values = (rng.standard_normal(shape) * scale).astype(np.float32)  # [out, in] as numpy sees it
        if qtype is None:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", vocab, hidden, qtype=Q.Q8_0, scale=1.0)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden, scale=1.0)
        tensor(f"blk.{i}.ffn_norm.weight", hidden, scale=1.0)
        tensor(f"blk.{i}.attn_q.weight", hidden, hidden, qtype=Q.Q4_1)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, qtype=Q.Q4_1)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden, qtype=Q.Q8_0)
        tensor(f"blk.{i}.attn_output.weight", hidden, hidden, qtype=Q.Q4_1)
        tensor(f"blk.{i}.ffn_gate.weight", inter, hidden, qtype=Q.Q4_1)
        tensor(f"blk.{i}.ffn_up.weight", inter, hidden, qtype=Q.Q4_1)
        tensor(f"blk.{i}.ffn_down.weight", hidden, inter, qtype=Q.Q4_1)
    tensor("output_norm.weight", hidden, scale=1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
