"""Policy: a Hugging Face causal LM wrapper (response log-probs, entropy, full weights for sync)."""

from ais_lightning.policy.policy import (
    Policy,
    ResponseLogprobs,
    build_sequences,
    chunked_response_logprobs,
    load_named_tensors,
)

__all__ = ["Policy", "ResponseLogprobs", "build_sequences", "chunked_response_logprobs", "load_named_tensors"]
