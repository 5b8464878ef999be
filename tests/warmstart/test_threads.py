"""Issue #19: a warm start built at 1 and at 2 intra-op threads (separate processes) either is
bit-identical or lands under different cache keys; it never shares a key with different weights."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(int(sys.argv[1]))  # the run's thread count (ais-train's trainer.num_threads)
    from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
    from ais_lightning.policy import Policy
    from ais_lightning.tasks import get_task
    from ais_lightning.app.warmstart import WarmStartSettings, state_dict_sha256, warm_start

    task, tokenizer, out = get_task("arithmetic", digits=2, operators="+"), build_char_tokenizer(), {}
    for sft_threads in (1, 0):  # 1: the default fixed thread count; 0: whatever the run uses
        policy = Policy(build_tiny_qwen3(seed=0))
        settings = WarmStartSettings(
            steps=3, batch_size=64, eval_size=16, max_new_tokens=4, num_threads=sft_threads,
            cache_dir=sys.argv[2],
        )
        result = warm_start(policy, tokenizer, task, settings, seed=0, progress_bar=False)
        out[sft_threads] = {
            "key": result.key, "weights": state_dict_sha256(policy.model), "threads": torch.get_num_threads(),
        }
    print(json.dumps(out))
    """
)


def build_at(threads: int, cache_dir) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(threads), str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_one_and_two_threads_share_bits_or_not_a_key(tmp_path):
    one, two = build_at(1, tmp_path / "one"), build_at(2, tmp_path / "two")  # separate caches: both train
    for sft_threads in ("1", "0"):
        a, b = one[sft_threads], two[sft_threads]
        assert a["key"] != b["key"] or a["weights"] == b["weights"], (sft_threads, a, b)
    # the default (one SFT thread whatever the run uses) shares the result, bit for bit
    assert one["1"]["key"] == two["1"]["key"] and one["1"]["weights"] == two["1"]["weights"]
    # the run's thread count, when the SFT uses it, is in the key
    assert one["0"]["key"] != two["0"]["key"]
    # and the caller's setting is restored
    assert one["1"]["threads"] == one["0"]["threads"] == 1 and two["1"]["threads"] == two["0"]["threads"] == 2
