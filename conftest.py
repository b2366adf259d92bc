"""The tests' tiny models see a few dozen positions, fewer than one attention block of a real run
(kv.BLOCK): with blocks of 8 keys every decoding test reads and merges several of them."""
import pytest

import kv


@pytest.fixture(autouse=True)
def small_kv_blocks(monkeypatch):
    monkeypatch.setattr(kv, "BLOCK", 8)
