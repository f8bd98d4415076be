"""rope and rope_inv_freq: frequencies bit-identical to transformers, the Triton kernel (interpreter) against
rope_ref, and rope_ref against transformers' apply_rotary_pos_emb and a float64 complex-rotation formula."""

import pytest
import torch

from graphspec.kernels import use_backend
from graphspec.kernels.rope import rope, rope_inv_freq, rope_ref, rope_tables
from tests.kernels._compare import assert_close

# Same fp32 angle on both sides; cos/sin differ by ~1 ulp between numpy (interpreter) and torch,
# then one rounding to the output dtype: fp32 a few ulps of |x| <= ~5; fp16 may flip one rounding
# (2^-10); bf16: the interpreter truncates where torch rounds to nearest (< 1 ulp = 2^-7 relative).
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-5, 8e-3),
    torch.float16: (1e-5, 1e-3),
}
DTYPES = list(TOL)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


# --- rope_inv_freq against transformers -----------------------------------------------------------


def _hf_inv_freq(head_dim, theta, scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=131072, rope_parameters=params)
    if params["rope_type"] == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config)


@pytest.mark.parametrize("head_dim,theta,scaling", [
    (64, 10000.0, None),
    (128, 500000.0, None),
    (80, 1000000.0, {"rope_type": "default"}),
    (128, 500000.0, LLAMA3),  # Llama 3.1 8B
    (64, 500000.0, {**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 8192}),  # Llama 3.2 1B
    (64, 10000.0, {"rope_type": "linear", "factor": 4.0}),
])
def test_inv_freq_bit_identical_to_transformers(head_dim, theta, scaling):
    expected, expected_scaling = _hf_inv_freq(head_dim, theta, scaling)
    inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, scaling)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (head_dim // 2,)
    assert torch.equal(inv_freq, expected)
    assert attention_scaling == expected_scaling


def test_llama3_scaling_moves_only_low_frequencies():
    base, _ = rope_inv_freq(128, 500000.0)
    scaled, _ = rope_inv_freq(128, 500000.0, LLAMA3)
    assert torch.equal(scaled[:10], base[:10])  # short wavelengths kept
    assert_close(scaled[-5:], base[-5:] / 8.0, 0, 1e-6, name="long wavelengths divided by factor")
    assert bool((scaled <= base).all())


def test_legacy_type_key_is_read():
    assert torch.equal(rope_inv_freq(64, 1e4, {"type": "linear", "factor": 2.0})[0], rope_inv_freq(64, 1e4)[0] / 2.0)


@pytest.mark.parametrize("args,match", [
    ((63, 1e4, None), "head_dim"),
    ((0, 1e4, None), "head_dim"),
    ((64, 0.0, None), "theta"),
    ((64, 1e4, {"rope_type": "yarn", "factor": 4.0}), "rope_type"),
    ((64, 1e4, {"rope_type": "dynamic", "factor": 4.0}), "rope_type"),
    ((64, 1e4, {"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    ((64, 1e4, {"rope_type": "linear"}), "factor"),
    ((64, 1e4, {"rope_type": "linear", "factor": -1}), "factor"),
    ((64, 1e4, {**LLAMA3, "high_freq_factor": 1.0}), "high_freq_factor"),
    ((64, 1e4, {"partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    ((64, 1e4, [("rope_type", "linear")]), "scaling"),
])
def test_inv_freq_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        rope_inv_freq(*args)


# --- rope kernel against rope_ref -------------------------------------------------------------------


def _positions(b, t, high=100000):
    # Not contiguous, not sorted, repeats allowed: verify blocks and padded batches look like this.
    return torch.randint(0, high, (t, b)).t()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,t,hq,hk,d", [
    (1, 1, 4, 1, 64),
    (2, 3, 6, 2, 80),  # head_dim/2 = 40: a masked tail in the half-dimension block
    (1, 17, 3, 3, 128),
    (3, 2, 1, 1, 2),
    (1, 2, 40, 8, 128),  # more q heads than one head tile
])
def test_triton_matches_reference(b, t, hq, hk, d, dtype):
    q = torch.randn(b, t, hq, d).to(dtype)
    k = torch.randn(b, t, hk, d).to(dtype)
    pos = _positions(b, t)
    inv_freq, _ = rope_inv_freq(d, 500000.0, LLAMA3)
    with use_backend("triton"):
        q_out, k_out = rope(q, k, pos, inv_freq, 1.25)  # a non-trivial attention_scaling must be applied
    rq, rk = rope_ref(q, k, pos, inv_freq, 1.25)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    assert_close(q_out, rq, *TOL[dtype], name=f"rope q {dtype}")
    assert_close(k_out, rk, *TOL[dtype], name=f"rope k {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(dtype):
    b, t, hq, hk, d = 2, 5, 4, 2, 64
    qkv = torch.randn(b, t, hq + 2 * hk, d).to(dtype)  # one fused projection, split into views
    q, k = qkv[:, :, :hq], qkv[:, :, hq:hq + hk]
    qt = torch.randn(b, hq, t, d).to(dtype).transpose(1, 2)  # [B, T, H, D] view of a [B, H, T, D] buffer
    pos = _positions(b, t)
    inv_freq, scaling = rope_inv_freq(d, 10000.0)
    assert not (q.is_contiguous() or k.is_contiguous() or qt.is_contiguous() or pos.is_contiguous())
    with use_backend("triton"):
        q_out, k_out = rope(q, k, pos, inv_freq, scaling)
        qt_out, _ = rope(qt, k, pos, inv_freq, scaling)
    rq, rk = rope_ref(q, k, pos, inv_freq, scaling)
    assert_close(q_out, rq, *TOL[dtype], name="strided q")
    assert_close(k_out, rk, *TOL[dtype], name="strided k")
    assert_close(qt_out, rope_ref(qt, k, pos, inv_freq, scaling)[0], *TOL[dtype], name="transposed q")
    assert torch.equal(qkv[:, :, :hq], q)  # out of place: inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_path_is_bit_identical_to_reference(dtype):
    # The CPU path rotates with precomputed tables (rope_tables, shared by a forward's layers):
    # the same products and sums as rope_ref, so the same bits, with or without tables given.
    b, t, hq, hk, d = 2, 5, 6, 2, 80
    qkv = torch.randn(b, t, hq + 2 * hk, d).to(dtype)
    q, k = qkv[:, :, :hq], qkv[:, :, hq:hq + hk]
    pos = _positions(b, t)
    inv_freq, _ = rope_inv_freq(d, 500000.0, LLAMA3)
    rq, rk = rope_ref(q, k, pos, inv_freq, 1.25)
    with use_backend("torch"):
        for tables in (None, rope_tables(pos, inv_freq, 1.25)):
            q_out, k_out = rope(q, k, pos, inv_freq, 1.25, tables)
            assert torch.equal(q_out, rq) and torch.equal(k_out, rk)
            assert q_out.is_contiguous() and k_out.is_contiguous()
        with pytest.raises(ValueError, match="rope_tables"):
            rope(q, k, pos, inv_freq, 1.25, rope_tables(pos[:, :1], inv_freq, 1.25))
    with use_backend("triton"):
        assert rope_tables(pos, inv_freq, 1.25) is None  # the kernel computes cos/sin itself


def test_int32_positions_and_position_zero_is_identity():
    q = torch.randn(1, 3, 2, 16)
    k = torch.randn(1, 3, 1, 16)
    inv_freq, _ = rope_inv_freq(16, 10000.0)
    pos = torch.zeros(1, 3, dtype=torch.int32)
    with use_backend("triton"):
        q_out, k_out = rope(q, k, pos, inv_freq)
    assert_close(q_out, q, 0, 0, name="rotation by angle 0")
    assert_close(k_out, k, 0, 0, name="rotation by angle 0")


# --- rope_ref against transformers and float64 -----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_transformers(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, t, hq, hk, d = 2, 6, 4, 2, 64
    q = torch.randn(b, t, hq, d).to(dtype)
    k = torch.randn(b, t, hk, d).to(dtype)
    pos = _positions(b, t, high=9000)
    inv_freq, scaling = rope_inv_freq(d, 500000.0, LLAMA3)
    freqs = pos[..., None].float() * inv_freq  # HF LlamaRotaryEmbedding.forward
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
    hq_out, hk_out = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)  # our [B, T, H, D] layout
    rq, rk = rope_ref(q, k, pos, inv_freq, scaling)
    if dtype == torch.float32:
        assert torch.equal(rq, hq_out) and torch.equal(rk, hk_out)  # same ops, same order
    else:
        # HF rounds cos/sin and each product to bf16; we round once: <= ~3 bf16 ulps apart.
        assert_close(rq, hq_out, 2e-2, 2.4e-2, name="bf16 rope_ref vs HF")
        assert_close(rk, hk_out, 2e-2, 2.4e-2, name="bf16 rope_ref vs HF")


def test_reference_matches_complex_rotation_in_float64():
    # Independent formula: pair (x[i], x[i + D/2]) as a complex number and multiply by e^{i f}.
    b, t, h, d = 1, 4, 3, 32
    q = torch.randn(b, t, h, d)
    pos = _positions(b, t, high=5000)
    inv_freq, _ = rope_inv_freq(d, 10000.0)
    angle = (pos[..., None].float() * inv_freq).double()[:, :, None, :]  # the same fp32 angle
    z = torch.complex(q[..., : d // 2].double(), q[..., d // 2:].double()) * torch.polar(torch.ones_like(angle), angle)
    expected = torch.cat((z.real, z.imag), dim=-1)
    assert_close(rope_ref(q, q, pos, inv_freq)[0], expected, 1e-5, 1e-5, name="rope_ref vs complex float64")


@pytest.mark.parametrize("call,match", [
    (lambda q, k, p, f: rope(q[0], k, p, f), "q"),
    (lambda q, k, p, f: rope(q, k[..., :-2], p, f), "k"),
    (lambda q, k, p, f: rope(q, k[:1], p, f), "k"),
    (lambda q, k, p, f: rope(q, k.half(), p, f), "k"),
    (lambda q, k, p, f: rope(q, k, p[:, :1], f), "positions"),
    (lambda q, k, p, f: rope(q, k, p.float(), f), "positions"),
    (lambda q, k, p, f: rope(q, k, p, f[:-1]), "inv_freq"),
    (lambda q, k, p, f: rope(q, k, p, f.double()), "inv_freq"),
    (lambda q, k, p, f: rope(q, k, p, f.to("meta")), "inv_freq"),
    (lambda q, k, p, f: rope(q, k.to("meta"), p, f), "k"),
    (lambda q, k, p, f: rope(q, k, p.to("meta"), f), "positions"),
    (lambda q, k, p, f: rope(q.double(), k.double(), p, f), "q"),
    (lambda q, k, p, f: rope(q[..., :-1], k[..., :-1], p, f), "head_dim"),
    (lambda q, k, p, f: rope(q, k, p, f, attention_scaling=None), "attention_scaling"),
])
def test_bad_input_raises_value_error_naming_argument(call, match):
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8)
    pos = torch.arange(3).expand(2, 3)
    inv_freq, _ = rope_inv_freq(8, 10000.0)
    with pytest.raises(ValueError, match=match):
        call(q, k, pos, inv_freq)
