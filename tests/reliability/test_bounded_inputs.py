"""Inputs are bounded and typed: each bad one is refused in seconds, naming it (issue #33, cases 3, 4 and 8).

- a GSM8K file with one 50 MB line used to be read whole (memory past 16 GB downstream): now refused naming
  the file and the line, reading at most ``task.max_line_bytes`` of it;
- prompts far past the model's context (2,000 tokens for a 512-position model) were generated from silently,
  10x slower: now refused naming the lengths, or cut when ``algorithm.truncate_prompts=true``;
- ``sync_weights(state_dict)`` failed with "too many values to unpack" and float token ids were silently
  truncated by ``generate``: every engine now names the argument.
"""

from __future__ import annotations

import json
import logging
import tracemalloc
from pathlib import Path

import pytest
import torch

from ais_lightning.app.build import validate
from ais_lightning.app.config import compose_train_config
from ais_lightning.models import build_tiny_diffusion, build_tiny_qwen3
from ais_lightning.rollout.base import SamplingConfig
from ais_lightning.rollout.diffusion_engine import DiffusionRolloutEngine
from ais_lightning.rollout.torch_engine import TorchRolloutEngine
from ais_lightning.tasks import get_task

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROW = {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=7\n#### 7"}


def _gsm8k_file(path: Path, huge_line: int, megabytes: int = 50) -> Path:
    with open(path, "w") as f:
        for lineno in range(1, 5):
            if lineno == huge_line:
                f.write('{"question": "')
                chunk = "x" * (1 << 20)
                for _ in range(megabytes):
                    f.write(chunk)
                f.write('", "answer": "#### 1"}\n')
            else:
                f.write(json.dumps(ROW) + "\n")
    return path


# ------------------------------------------------------------------------------------ case 3: a huge line
def test_a_gsm8k_file_with_a_50mb_line_is_refused_naming_the_line_without_reading_it(tmp_path: Path):
    path = _gsm8k_file(tmp_path / "gsm8k.jsonl", huge_line=3)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as err:
            get_task("gsm8k", path=str(path), use_datasets=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert f"gsm8k file {path} line 3 is longer than task.max_line_bytes=1048576 bytes" in message, message
    assert peak < 8 << 20, f"{peak / 2**20:.0f} MiB allocated to refuse the line"


def test_the_line_bound_is_a_config_key_checked_before_anything_heavy(tmp_path: Path):
    path = _gsm8k_file(tmp_path / "small.jsonl", huge_line=2, megabytes=1)
    cfg = compose_train_config(
        ["task=gsm8k", f"task.path={path}", "task.use_datasets=false", "output_dir=unused"]
    )
    with pytest.raises(
        ValueError, match=r"task: gsm8k file .*small\.jsonl line 2 is longer than task\.max_line_bytes"
    ):
        validate(cfg)
    task = get_task("gsm8k", path=str(path), use_datasets=False, max_line_bytes=2 << 20)  # raised: accepted
    assert len(task.rows) == 4
    with pytest.raises(ValueError, match="max_line_bytes"):
        get_task("gsm8k", path=str(path), use_datasets=False, max_line_bytes=0)


def test_a_huge_row_of_a_json_array_is_refused_naming_the_element(tmp_path: Path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([ROW, {"question": "y" * 5000, "answer": "#### 2"}]))
    with pytest.raises(ValueError, match=r"rows\.json element 1 is longer than task\.max_line_bytes=4096"):
        get_task("gsm8k", path=str(path), use_datasets=False, max_line_bytes=4096)


# ----------------------------------------------------------------------- case 4: prompts past the context
@pytest.fixture(scope="module")
def qwen3():
    return build_tiny_qwen3(seed=0)  # 512 positions


def test_a_prompt_past_the_models_context_is_refused_naming_the_lengths(qwen3):
    assert qwen3.config.max_position_embeddings == 512
    engine = TorchRolloutEngine(qwen3, precision="fp32")
    prompts = [[5] * 10, [6] * 2000]
    with pytest.raises(ValueError) as err:
        engine.generate(prompts, SamplingConfig(max_new_tokens=8))
    message = str(err.value)
    assert "prompts[1] has 2000 tokens" in message and "max_new_tokens=8" in message, message
    assert "2008 positions" in message and "context of 512" in message, message
    fits = engine.generate([[5] * 504], SamplingConfig(max_new_tokens=8, seed=0))  # exactly the context
    assert fits.response_ids.shape == (1, 8)


def test_the_diffusion_engine_refuses_a_prompt_past_its_context_too():
    model = build_tiny_diffusion(seed=0)
    engine = DiffusionRolloutEngine(model)
    context = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"prompts\[0\] has {context} tokens; .* context of {context}"):
        engine.generate([[20] * context], SamplingConfig(max_new_tokens=8))


def _module(*overrides: str):
    cfg = compose_train_config(["experiment=smoke", "output_dir=unused", *overrides])
    c = validate(cfg)
    return c.grpo_module(c.policy.build(0), 0)


def test_ais_train_refuses_long_prompts_unless_asked_to_truncate_them(caplog):
    long_prompt = "12+34=" * 400  # 2,400 characters: tokens of the built-in character-level tokenizer
    module = _module()
    max_new = module.settings.max_new_tokens
    with pytest.raises(ValueError, match=rf"prompts\[0\] has 2400 tokens; with max_new_tokens={max_new}"):
        module.encode_prompts([long_prompt])
    module = _module("algorithm.truncate_prompts=true")
    with caplog.at_level(logging.WARNING, logger="ais_lightning.modules.grpo"):
        (ids, short) = module.encode_prompts([long_prompt, "1+2="])
    assert len(ids) == 512 - max_new and ids == module.policy.encode_prompts([long_prompt])[0][-len(ids) :]
    assert short == module.policy.encode_prompts(["1+2="])[0]
    assert "1 of 2 prompts" in caplog.text and "truncate_prompts" in caplog.text


# ---------------------------------------------------------------------------- case 8: argument types
@pytest.fixture(scope="module", params=["torch", "diffusion"])
def engine(request, qwen3):
    if request.param == "torch":
        return TorchRolloutEngine(qwen3, precision="fp32")
    return DiffusionRolloutEngine(build_tiny_diffusion(seed=0))


def test_sync_weights_names_the_argument_when_given_a_state_dict(engine):
    state = engine.model.state_dict()
    with pytest.raises(
        ValueError, match=r"sync_weights\(named_tensors\) takes \(name, tensor\) pairs, got a "
    ):
        engine.sync_weights(state)
    with pytest.raises(ValueError, match=r"state_dict\.items\(\)"):
        engine.sync_weights(dict(state))
    with pytest.raises(ValueError, match=r"named_tensors\[0\] must be a \(name, tensor\) pair"):
        engine.sync_weights(list(state))  # names only
    with pytest.raises(ValueError, match=r"named_tensors\[0\] has a int name"):
        engine.sync_weights([(0, next(iter(state.values())))])
    with pytest.raises(ValueError, match=r"iterable of \(name, tensor\) pairs, got Tensor"):
        engine.sync_weights(next(iter(state.values())))
    engine.sync_weights(state.items())  # the right call still works


def test_generate_refuses_float_token_ids_and_a_wrong_sampling_argument(engine):
    sampling = SamplingConfig(max_new_tokens=4, seed=0)
    with pytest.raises(ValueError, match=r"prompts\[0\]\[1\] must be an integer token id, got float 21\.7"):
        engine.generate([[20, 21.7, 22]], sampling)
    with pytest.raises(ValueError, match=r"prompts\[1\]\[0\] must be an integer token id, got bool"):
        engine.generate([[20], [True]], sampling)
    with pytest.raises(ValueError, match=r"prompts must be a non-empty list of token-id lists, got Tensor"):
        engine.generate(torch.tensor([[20, 21]]), sampling)
    with pytest.raises(ValueError, match=r"sampling must be a SamplingConfig, got dict"):
        engine.generate([[20, 21]], {"max_new_tokens": 4})
    ok = engine.generate([[20, 21, torch.tensor(22)]], sampling)  # integer ids of any integer type
    assert ok.prompt_ids.dtype == torch.long
