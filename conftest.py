"""The tests' shared settings.

`python -m pytest -q` runs the quick suite, which checks every exactness claim at least once;
`python -m pytest -q --runslow` runs the whole suite: the tests marked slow too (compile matrices,
the training smoke run, sweeps, long subprocess runs), each a longer check of a claim the quick
suite also checks.

The tests' tiny models see a few dozen positions, fewer than one attention block of a real run
(engine/kv_cache.py's BLOCK): with blocks of 8 keys every decoding test reads and merges several of
them."""
import os

import pytest
import torch

import models
from engine import kv_cache

TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "testdata")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true",
                     help="run the whole suite, the slow tests too")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: in the whole suite only (--runslow)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    slow = [item for item in items if "slow" in item.keywords]
    config.hook.pytest_deselected(items=slow)
    items[:] = [item for item in items if "slow" not in item.keywords]


@pytest.fixture(autouse=True)
def small_kv_blocks(monkeypatch):
    monkeypatch.setattr(kv_cache, "BLOCK", 8)


@pytest.fixture
def one_thread():
    """torch on one thread: the tiny models' and the demo's matmuls are too small to share between
    cores, and lose much when another process holds one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# the golden checkpoints (tests/testdata/) as the goldens' official runs load them, one per module
@pytest.fixture(scope="module")
def huginn():
    return models.load(os.path.join(TESTDATA, "huginn_A"), state_init="zero")


@pytest.fixture(scope="module")
def ouro():
    return models.load(os.path.join(TESTDATA, "ouro_A"))


@pytest.fixture(scope="module")
def parcae():
    return models.load(os.path.join(TESTDATA, "parcae_A"), state_init="zero")
