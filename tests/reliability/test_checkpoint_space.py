"""The check before a run trains that its checkpoints fit on the disk: counts and sizes by hand, and the warning."""

from __future__ import annotations

import logging
from collections import namedtuple
from types import SimpleNamespace

import torch

from ais_lightning.app import checkpoint_space
from ais_lightning.app.checkpoint_space import (
    check_checkpoint_space,
    checkpoint_bytes,
    checkpoint_files,
    space_warning,
    tensor_bytes,
)

Usage = namedtuple("Usage", "total used free")


def test_files_held_at_once_are_the_kept_periodic_ones_last_and_the_one_being_written():
    assert checkpoint_files(max_steps=200, every_n_steps=0, keep=0) == 2  # last.ckpt and its rewrite
    assert checkpoint_files(max_steps=200, every_n_steps=50, keep=0) == 4 + 2
    assert checkpoint_files(max_steps=200, every_n_steps=50, keep=2) == 2 + 2
    assert checkpoint_files(max_steps=200, every_n_steps=50, keep=10) == 4 + 2  # fewer written than kept
    assert checkpoint_files(max_steps=7, every_n_steps=3, keep=0) == 2 + 2


def test_tied_weights_count_once_as_torch_save_stores_them():
    embed = torch.zeros(5, 4)  # 80 bytes
    assert tensor_bytes([embed, embed, embed[:2], "not a tensor", torch.ones(3)]) == 80 + 12
    assert tensor_bytes([torch.empty(3, device="meta"), torch.empty(5, device="meta")]) == 12 + 20
    tied = torch.nn.Module()
    tied.embed, tied.head = torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False)
    tied.head.weight = tied.embed.weight
    assert tensor_bytes(tied.state_dict().values()) == 80  # two keys, one tensor


def test_bytes_are_the_state_two_adam_moments_and_the_snapshots():
    assert checkpoint_bytes(state=100, trained=60) == 100 + 2 * 60
    assert checkpoint_bytes(state=100, trained=60, snapshot=80, snapshots=3) == 100 + 120 + 240


def test_the_warning_names_directory_need_and_free_space(tmp_path):
    assert space_warning(one=10**9, files=3, free=3 * 10**9, directory=tmp_path) is None
    text = space_warning(one=10**9, files=3, free=2 * 10**9, directory=tmp_path)
    assert str(tmp_path) in text and "3.00 GB" in text and "2.00 GB free" in text
    assert "trainer.keep_checkpoints" in text


def test_a_module_is_measured_and_warned_about(tmp_path, monkeypatch, caplog):
    module = torch.nn.Module()
    module.policy = torch.nn.Linear(10, 10)  # 110 float32 parameters, all trained: 440 bytes
    module.policy.bias.requires_grad_(False)  # 10 of them frozen: 40 bytes without moments
    module.staleness = SimpleNamespace(snapshots=SimpleNamespace(keep=2))  # two snapshots of the 440 bytes
    settings = SimpleNamespace(max_steps=10, checkpoint_every_n_steps=5, keep_checkpoints=0)  # 2 + 2 files
    expected = 440 + 2 * 400 + 2 * 440
    monkeypatch.setattr(checkpoint_space.shutil, "disk_usage", lambda _: Usage(0, 0, 4 * expected))
    with caplog.at_level(logging.INFO, logger=checkpoint_space.__name__):
        assert check_checkpoint_space(module, settings, tmp_path) == expected
    assert "at most 4 at once" in caplog.text and "may not fit" not in caplog.text

    monkeypatch.setattr(checkpoint_space.shutil, "disk_usage", lambda _: Usage(0, 0, 4 * expected - 1))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=checkpoint_space.__name__):
        check_checkpoint_space(module, settings, tmp_path)
    assert [r.levelname for r in caplog.records if "may not fit" in r.getMessage()] == ["WARNING"]
