"""What every graphspec CPU GEMM owes its callers beyond its numbers (the int8 and int4 GEMMs' tests)."""

import pytest
import torch


def check_gemm_contract(gemm, x: torch.Tensor, n: int, columns_error: str) -> None:
    """``gemm.forward``: the same bits with 1 and 2 threads, an empty result for no rows, and errors that say
    what was wrong for a wrong column count (``columns_error``, a regex) and a non-fp32 x."""
    k = x.shape[1]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = gemm.forward(x)
        torch.set_num_threads(1)
        assert torch.equal(gemm.forward(x), two)  # a row's result does not depend on the thread count
    finally:
        torch.set_num_threads(threads)
    assert gemm.forward(x[:0]).shape == (0, n)
    with pytest.raises(RuntimeError, match=columns_error):
        gemm.forward(torch.zeros(1, k + 1))
    with pytest.raises(RuntimeError, match="fp32"):
        gemm.forward(torch.zeros(1, k, dtype=torch.float64))
