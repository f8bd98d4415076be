"""graphspec.kernels: one op per file, each a Triton kernel, its launcher and a torch reference.

See ``_dispatch`` for how an op picks Triton or torch.
"""

from graphspec.kernels._dispatch import (EXACT_CHAIN_ROWS_MAX, EXACT_ROWS_MAX, batched_rows, use_backend,  # noqa: F401
                                        requested_backend)
from graphspec.kernels.attention import attention, attention_ref  # noqa: F401
from graphspec.kernels.sampling import warp_logits, warp_logits_ref, sample, sample_ref, exponential_noise  # noqa: F401
from graphspec.kernels.rejection import rejection_sample, rejection_sample_ref  # noqa: F401
from graphspec.kernels.linear import linear, linear_ref  # noqa: F401
from graphspec.kernels.rmsnorm import rmsnorm, rmsnorm_ref  # noqa: F401
from graphspec.kernels.rope import rope, rope_ref, rope_inv_freq  # noqa: F401
from graphspec.kernels.silu_mul import silu_mul, silu_mul_ref  # noqa: F401
from graphspec.kernels.vocab_map import vocab_map, vocab_map_ref, vocab_mask_logits, vocab_mask_logits_ref  # noqa: F401
