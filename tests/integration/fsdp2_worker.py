"""Worker for tests/integration/test_fsdp2.py (not a test module).

    python fsdp2_worker.py sharded OUT   # 2 processes, Lightning ModelParallelStrategy (FSDP2), gloo on CPU
    python fsdp2_worker.py single OUT    # 1 process, replays the rollouts both ranks generated

Both run one GRPO step of the same GRPOModule. The sharded run records, per rank, the prompt batch it
got and the rollouts its (real, fp32 torch) engine generated; the single-process run feeds the
concatenation of both ranks' rollouts through the same module. Dr. GRPO aggregation
(seq-mean-token-sum-norm) makes the global loss the mean of the two equal-sized ranks' losses, which is
exactly what FSDP's gradient averaging computes, so loss and updated weights must agree.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from ais_lightning.correctors import AIS
from ais_lightning.losses import GRPOLoss
from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.modules.grpo import GRPOModule, GRPOSettings
from ais_lightning.policy import Policy
from ais_lightning.rollout.base import RolloutBatch, RolloutEngine
from ais_lightning.rollout.torch_engine import TorchRolloutEngine
from ais_lightning.tasks import get_task
from ais_lightning.tasks.arithmetic import Arithmetic


class OddCharacters(Arithmetic):
    """Arithmetic prompts, but a reward a random model already varies on: the fraction of odd code points.

    (The exact-match reward of an untrained model is 0 everywhere, so every advantage would be 0.)
    """

    def reward(self, prompts, completions, **fields):
        return [sum(ord(c) % 2 for c in text) / max(len(text), 1) for text in completions]


PROMPTS_PER_RANK = 4
GROUP = 4
LR = 1e-3


class Recording(RolloutEngine):
    """Wraps a real engine and keeps every batch it generated."""

    def __init__(self, engine):
        self.engine, self.batches = engine, []

    def sync_weights(self, named):
        self.engine.sync_weights(named)

    def generate(self, prompts, sampling):
        batch = self.engine.generate(prompts, sampling)
        self.batches.append(batch)
        return batch


class Replay(RolloutEngine):
    """Returns a recorded batch instead of generating (the single-process reference)."""

    def __init__(self, batch: RolloutBatch):
        self.batch = batch

    def sync_weights(self, named):
        pass

    def generate(self, prompts, sampling):
        return self.batch


def _pad(x: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    extra = width - x.shape[1]
    if extra == 0:
        return x
    fill = torch.full((x.shape[0], extra), value, dtype=x.dtype)
    return torch.cat([fill, x] if left else [x, fill], dim=1)


def concat(a: RolloutBatch, b: RolloutBatch, b_prompt_offset: int, pad_id: int) -> RolloutBatch:
    p = max(a.prompt_ids.shape[1], b.prompt_ids.shape[1])
    t = max(a.response_ids.shape[1], b.response_ids.shape[1])
    return RolloutBatch(
        prompt_ids=torch.cat([_pad(a.prompt_ids, p, pad_id, True), _pad(b.prompt_ids, p, pad_id, True)]),
        prompt_mask=torch.cat([_pad(a.prompt_mask, p, False, True), _pad(b.prompt_mask, p, False, True)]),
        response_ids=torch.cat(
            [_pad(a.response_ids, t, pad_id, False), _pad(b.response_ids, t, pad_id, False)]
        ),
        response_mask=torch.cat(
            [_pad(a.response_mask, t, False, False), _pad(b.response_mask, t, False, False)]
        ),
        rollout_logprobs=torch.cat(
            [_pad(a.rollout_logprobs, t, 0.0, False), _pad(b.rollout_logprobs, t, 0.0, False)]
        ),
        finish_reason=a.finish_reason + b.finish_reason,
        prompt_index=torch.cat([a.prompt_index, b.prompt_index + b_prompt_offset]),
    )


def make_module(engine_factory) -> GRPOModule:
    return GRPOModule(
        policy=Policy(build_tiny_qwen3(seed=0), build_char_tokenizer()),
        task=OddCharacters(digits=1),
        corrector=AIS(),
        loss=GRPOLoss(aggregation="seq-mean-token-sum-norm", max_response_length=4),
        engine_factory=engine_factory,
        settings=GRPOSettings(group_size=GROUP, max_new_tokens=4, lr=LR, grad_clip=0.0),
        seed=0,
    )


class RecordBatches(L.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append(batch)


def trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **kwargs,
    )


def sharded(out: Path) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from ais_lightning.tasks import PromptDataModule

    engines = []

    def factory(model):
        engines.append(Recording(TorchRolloutEngine(model, precision="fp32")))
        return engines[-1]

    module = make_module(factory)
    recorder = RecordBatches()
    strategy = ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
    )
    t = trainer(devices=2, strategy=strategy, callbacks=[recorder])
    data = PromptDataModule(
        get_task("arithmetic", digits=1),
        train_size=2 * PROMPTS_PER_RANK,
        val_size=1,
        batch_size=PROMPTS_PER_RANK,
    )
    initial = dict(Policy(build_tiny_qwen3(seed=0)).full_state_dict())
    t.fit(module, datamodule=data)
    final = dict(module.policy.full_state_dict())  # collective: every rank calls it
    rank = t.global_rank
    torch.save(
        {
            "batch": recorder.batches[0],
            "rollout": engines[0].batches[0],
            "loss": float(t.callback_metrics["loss/pg_loss"]),
            "lambda": float(t.callback_metrics["ais/lambda"]),
        },
        out / f"rank{rank}.pt",
    )
    if rank == 0:
        torch.save({"initial": initial, "final": final}, out / "weights_sharded.pt")


def single(out: Path) -> None:
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    tokenizer = build_char_tokenizer()
    offset = len(r0["batch"]["prompt"])
    rollout = concat(r0["rollout"], r1["rollout"], offset, tokenizer.pad_token_id)
    batch = {k: list(r0["batch"][k]) + list(r1["batch"][k]) for k in r0["batch"]}
    module = make_module(lambda model: Replay(rollout))
    t = trainer(devices=1)
    loader = DataLoader([batch], batch_size=None, collate_fn=lambda b: b)
    t.fit(module, train_dataloaders=loader)
    torch.save(
        {
            "loss": float(t.callback_metrics["loss/pg_loss"]),
            "lambda": float(t.callback_metrics["ais/lambda"]),
            "final": dict(module.policy.full_state_dict()),
        },
        out / "single.pt",
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    {"sharded": sharded, "single": single}[mode](out_dir)
