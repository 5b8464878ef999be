"""Fixtures shared by test modules in several folders."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tiny matmuls (no barrier stalls when the cores are shared), restored
    afterwards. Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
