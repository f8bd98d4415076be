"""Fixtures for the framework tests."""

import pytest
import torch


@pytest.fixture
def single_thread():
    """Run torch single-threaded: on tiny shapes, intra-op threads only add synchronisation, which on a
    busy 2-core machine costs milliseconds per op (measured: a [3, 32] x [32, 96] linear 3 ms with 2
    threads under load, 0.02 ms with 1)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
