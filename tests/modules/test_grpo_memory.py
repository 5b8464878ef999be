"""GRPOModule's memory and time savings change no number: gradients freed after the update,
values-only entropy for pi_old, one engine for an fp32 rollout and its validation, engines kept from a
validation to ``fit``, validation batches of their own size."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from ais_lightning.app.build import validate
from ais_lightning.app.config import compose_train_config
from ais_lightning.modules.grpo import GRPOModule, GRPOSettings, same_engine
from ais_lightning.rollout import TorchRolloutEngine
from tests.modules.test_grpo_module import _fit, _module, _weights

BATCH = {"prompt": ["1+2=", "3+4=", "5+1="], "solution": ["3", "7", "6"], "answer": [3, 7, 6]}


class RecordedEntropy(GRPOModule):
    """GRPOModule whose pi_old pass records the entropy for autograd (as before values-only entropy)."""

    @property
    def _loss_needs_entropy(self) -> bool:
        return True


def test_gradients_are_freed_after_the_update():
    module = _module()
    _fit(module)
    assert all(p.grad is None for p in module.policy.parameters())


def test_values_only_entropy_for_pi_old_changes_no_weight_bit_for_bit():
    """pi_old's entropy feeds metrics and the corrector; computing it without autograd (the loss has no
    entropy term) leaves the update exactly as it was."""
    values, recorded = _module(), _module(cls=RecordedEntropy)
    _fit(values), _fit(recorded)
    a, b = _weights(values), _weights(recorded)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_same_engine_compares_the_filled_in_arguments():
    fp32 = functools.partial(TorchRolloutEngine, precision="fp32")
    assert same_engine(fp32, fp32)
    assert same_engine(fp32, functools.partial(TorchRolloutEngine, precision="fp32", kv_cache_dtype="auto"))
    assert not same_engine(fp32, functools.partial(TorchRolloutEngine, precision="fp4"))
    assert not same_engine(lambda m: None, lambda m: None)


class Counting(GRPOModule):
    """Counts engine builds and validation generations."""

    builds = 0
    generations = 0

    def _build_engine(self, factory, state):
        self.builds += 1
        engine = super()._build_engine(factory, state)
        generate = engine.generate

        def counted(*args, **kwargs):
            if self.trainer.validating:
                self.generations += 1
            return generate(*args, **kwargs)

        engine.generate = counted
        return engine


def _validate_then_fit(module: GRPOModule) -> L.Trainer:
    """``ais-train``'s order: a validation before training, then ``fit`` with a validation after its step."""
    loader = DataLoader([BATCH], batch_size=None, collate_fn=lambda b: b)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.validate(module, dataloaders=loader, verbose=False)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    return trainer


@pytest.mark.parametrize("precision", ["fp32", "fp4", "int8"])
def test_engines_are_built_once_and_an_fp32_engine_serves_both_validations(precision):
    """An fp32 rollout engine is the trainer-precision engine: one copy of the model, one greedy generation
    per validation batch, both accuracies logged (equal). At fp4 the two engines differ. Engines built for the
    validation before ``fit`` are kept: ``fit`` gives them the current weights instead of building them again."""
    module = _module(
        engine_factory=functools.partial(TorchRolloutEngine, precision=precision), cls=Counting, val_size=3
    )
    module.engines.eval_engine_factory = functools.partial(TorchRolloutEngine, precision="fp32")
    trainer = _validate_then_fit(module)
    shared = precision == "fp32"
    assert (module.eval_engine is module.engine) == shared
    assert module.builds == (1 if shared else 2)
    assert module.generations == (2 if shared else 4), "two validations"
    metrics = trainer.callback_metrics
    if shared:
        assert metrics["val/accuracy_trainer"] == metrics["val/accuracy_engine"]
    assert len(module.validation_history) == 2
    for engine in {id(e): e for e in (module.engine, module.eval_engine)}.values():
        if engine.precision == "fp32":  # holds the trained weights, as a freshly built engine would
            state = engine.model.state_dict()
            for name, value in module.policy.model.state_dict().items():
                torch.testing.assert_close(state[name], value, rtol=0, atol=0)


def test_val_batch_size_sets_the_validation_batches():
    default = validate(compose_train_config(["output_dir=unused", "algorithm.prompts_per_step=3"]))
    assert default.algorithm.val_batch_size is None
    assert default.prompt_data(1, 0).val_dataloader().batch_size == 3
    own = validate(compose_train_config(["output_dir=unused", "algorithm.val_batch_size=7"]))
    assert own.prompt_data(1, 0).val_dataloader().batch_size == 7
    with pytest.raises(ValueError, match="val_batch_size"):
        GRPOSettings(val_batch_size=0)


class ReservingEngine(TorchRolloutEngine):
    """A torch engine declaring, as vLLM does, that it claims a share of the free device memory when it starts;
    records the ``reserve_bytes`` it was built with."""

    RESERVES_TRAINER_MEMORY = True
    reserves: list[int] = []

    def __init__(self, model, reserve_bytes: int = 0, **kwargs):
        ReservingEngine.reserves.append(reserve_bytes)
        super().__init__(model, **kwargs)


def test_an_engine_claiming_free_memory_leaves_room_for_the_gradients_and_adamw_states():
    """vLLM is built before the first step, when neither AdamW's two states (``zeros_like`` of each parameter,
    created at its first step) nor the gradients exist: the module tells such an engine how much memory they will
    take, so its share of the free memory is not taken out of theirs. Once the states exist, only the gradients
    (freed after every update) are still to come."""
    ReservingEngine.reserves.clear()
    module = _module(engine_factory=functools.partial(ReservingEngine, precision="fp32", reserve_bytes=1000))
    params = [p for p in module.policy.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    _fit(module)  # builds the engine when training starts, before the first step
    assert ReservingEngine.reserves == [1000 + 3 * param_bytes]  # the configured reserve + grads + 2 states
    module.close_engines()
    module._build_engine(module.engines.engine_factory, module._full_state())  # AdamW's states exist now
    assert ReservingEngine.reserves[-1] == 1000 + param_bytes  # only the gradients are still to come
    plain = _module(engine_factory=functools.partial(TorchRolloutEngine, precision="fp32"))
    _fit(plain)  # an engine that claims nothing is built as before (no reserve_bytes argument)
