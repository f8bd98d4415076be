"""Tensor comparison for kernel tests that says *where* a kernel went wrong.

``assert_close`` checks ``|actual - expected| <= atol + rtol * |expected|`` elementwise
(the same rule as ``torch.testing.assert_close``) after upcasting both sides to float64,
and on failure lists the worst offenders with their indices, so a masking bug
(a bad tail tile, a wrong stride) shows up as a pattern of indices rather than one number.
"""

from __future__ import annotations

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float,
                 name: str = "output", max_report: int = 8) -> None:
    """Assert ``actual`` matches ``expected`` within ``atol + rtol * |expected|``.

    Shapes must match exactly; dtypes may differ (both sides are compared in float64).
    NaNs must sit at the same places on both sides; infinities must match exactly.
    """
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise AssertionError(f"{name}: expected two tensors, got {type(actual).__name__} and {type(expected).__name__}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return

    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    both_nan = nan_a & nan_e
    # Equal infinities give inf - inf = nan below; treat exact equality as a match first.
    equal = (a == e) | both_nan
    diff = (a - e).abs()
    allowed = atol + rtol * e.abs()
    bad = ~equal & ~(diff <= allowed)  # nan diff (one side nan or mismatched inf) counts as bad
    n_bad = int(bad.sum())
    if n_bad == 0:
        return

    # Rank offenders by how far past their allowance they are (nan/inf first).
    excess = torch.where(torch.isfinite(diff), diff - allowed, torch.full_like(diff, float("inf")))
    excess = torch.where(bad, excess, torch.full_like(excess, -float("inf")))
    k = min(max_report, n_bad)
    worst = torch.topk(excess.flatten(), k).indices
    lines = []
    for flat in worst.tolist():
        idx = tuple(torch.unravel_index(torch.tensor(flat), a.shape)) if a.ndim else ()
        idx = tuple(int(i) for i in idx)
        lines.append(f"  at {idx}: actual={a.flatten()[flat].item():.8g} expected={e.flatten()[flat].item():.8g} "
                     f"|diff|={diff.flatten()[flat].item():.3g} allowed={allowed.flatten()[flat].item():.3g}")
    finite = torch.isfinite(diff)
    max_abs = diff[finite].max().item() if finite.any() else float("nan")
    raise AssertionError(
        f"{name}: {n_bad} of {a.numel()} elements differ beyond atol={atol:g}, rtol={rtol:g} "
        f"(max finite |diff| {max_abs:.3g}; actual dtype {actual.dtype}, expected dtype {expected.dtype}, "
        f"shape {tuple(a.shape)}); worst:\n" + "\n".join(lines)
    )


def attention_inputs(B, T, L, Hq, Hk, D, dtype, s_max=None, q_strided=False):
    """q and k/v as the model passes them: k/v strided slices [:, :L] of a preallocated cache."""
    s_max = s_max or L + 5
    k_cache = torch.randn(B, s_max, Hk, D).to(dtype)
    v_cache = torch.randn(B, s_max, Hk, D).to(dtype)
    if q_strided:  # a slice of a fused [B, T, Hq + 2 Hk, D] projection, as a fused QKV would give
        q = torch.randn(B, T, Hq + 2 * Hk, D).to(dtype)[:, :, :Hq]
    else:
        q = torch.randn(B, T, Hq, D).to(dtype)
    return q, k_cache[:, :L], v_cache[:, :L]
