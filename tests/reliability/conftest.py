"""Fixtures of the fault-injection tests that run ``ais-train`` inside the test process."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory):
    """``ais_lightning.app.train.run`` called in this process, as often as a module's tests like: a store file
    that a test may rewrite between runs (no pooled connections), a warm-start cache of the module's own, no
    tracking URI from the environment, and torch's thread count restored afterwards. Yields ``run(overrides)``,
    which composes the config and runs it."""
    from ais_lightning.app.config import compose_train_config
    from ais_lightning.app.train import run

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_SQLALCHEMYSTORE_POOLCLASS", "NullPool")
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.setenv("AIS_LIGHTNING_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield lambda overrides: run(compose_train_config(list(overrides)))
    torch.set_num_threads(threads)
