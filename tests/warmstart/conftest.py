import pytest

from ais_lightning.models import build_char_tokenizer
from ais_lightning.tasks import get_task


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def task():
    return get_task("arithmetic", digits=2, operators="+")
