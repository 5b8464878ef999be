"""``ais-train policy=local`` on causal LMs outside the Llama family, end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ais_lightning.models import build_char_tokenizer, save_tiny_model
from ais_lightning.quant.cpu_int8 import default_int8_backend
from tests.architectures import build
from tests.integration.helpers import SMOKE, run_train

pytestmark = pytest.mark.slow


def _saved(name: str, root: Path) -> str:
    """The tiny ``name`` model with the built-in character tokenizer, saved as a local model directory."""
    tokenizer = build_char_tokenizer()
    ids = {key: getattr(tokenizer, key) for key in ("pad_token_id", "bos_token_id", "eos_token_id")}
    return save_tiny_model(build(name, vocab_size=len(tokenizer), **ids), tokenizer, root / name)


@pytest.mark.parametrize("name", ["granite", "gpt2"])
def test_grpo_on_a_local_model_of_another_family(tmp_path: Path, name: str):
    """Granite (scaled logits: the policy's transform, the engine's own forward) with int8 rollouts on the integer GEMM;
    GPT-2 (Conv1D linears, which int8 cannot quantize) with fp32 rollouts."""
    rollout = "int8" if name == "granite" else "fp32"
    out = tmp_path / "run"
    proc = run_train(
        [*SMOKE, "policy=local", f"policy.path={_saved(name, tmp_path)}", f"rollout={rollout}", "logger=csv",
         "policy.gradient_checkpointing=true", f"hydra.run.dir={out}"],
        cwd=tmp_path,
    )  # fmt: skip
    # from_pretrained loads in eval mode; the policy trains in training mode (where checkpointing acts)
    assert "in eval mode at the start of training" not in proc.stderr
    backend = f"backend {default_int8_backend()}: " if rollout == "int8" else ""  # this CPU's int8 kernel
    assert (
        f"TorchRolloutEngine {rollout} ({backend}" in proc.stdout and "transformers forward)" in proc.stdout
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and math.isfinite(summary["kl_k3_mean"])
    if name == "granite":  # int8 rollouts differ from the fp32 trainer
        assert summary["kl_k3_mean"] > 0
    else:  # fp32 rollouts through GPT-2's own forward are the trainer's distribution
        assert summary["kl_k3_mean"] < 1e-6


def test_quantized_rollouts_of_gpt2_fail_before_the_warm_start_and_name_the_layer(tmp_path: Path):
    path = _saved("gpt2", tmp_path)
    args = [*SMOKE, "warmstart=default", "warmstart.enabled=true", "policy=local", f"policy.path={path}", "rollout=int8",
            "logger=none"]  # fmt: skip
    with pytest.raises(
        AssertionError, match=r"rollout \(TorchRolloutEngine on the policy's model\).*c_attn.weight"
    ):
        run_train(args, cwd=tmp_path)
    cache = tmp_path / "cache"  # run_train's AIS_LIGHTNING_CACHE: no warm start was trained or stored
    assert not any(cache.rglob("policy.pt"))


def test_a_local_model_prompted_in_its_chat_template(tmp_path: Path):
    """``policy.chat_template=true``: rollouts, validation and the warm start all see the rendered prompts."""
    from ais_lightning.models import build_tiny_qwen3

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    path = save_tiny_model(build_tiny_qwen3(seed=0), tokenizer, tmp_path / "chat")
    out = tmp_path / "run"
    run_train(
        [*SMOKE, "policy=local", f"policy.path={path}", "policy.chat_template=true", "warmstart=default",
         "warmstart.enabled=true", "warmstart.steps=2", "warmstart.eval_size=8", "warmstart.target_band=[0.0,1.0]", "logger=csv",
         f"hydra.run.dir={out}"],
        cwd=tmp_path,
    )  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["warm_start"]["eval_size"] == 8  # measured on rendered prompts
    (entry,) = (tmp_path / "cache").rglob("meta.json")
    assert "<assistant>" in entry.read_text()  # the template is part of the warm start's key payload
