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


@pytest.fixture(scope="module")
def tiny_pair_dirs(tmp_path_factory):
    """A tiny random target and draft sharing one tokenizer (chatml template), for the engine and server tests."""
    from tests.checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("pair")
    target = make_checkpoint(root / "target", "qwen2", hidden_size=96, layers=2, heads=6, kv_heads=2, seed=0,
                             chat_template="chatml")
    draft = make_checkpoint(root / "draft", "qwen2", hidden_size=64, layers=1, heads=4, kv_heads=2, seed=1,
                            chat_template="chatml")
    return target, draft
