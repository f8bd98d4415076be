"""graphspec.kernels: one op per file, each a Triton kernel, its launcher and a torch reference.

See ``_dispatch`` for how an op picks Triton or torch.
"""

from graphspec.kernels._dispatch import use_backend, requested_backend  # noqa: F401
from graphspec.kernels.attention import attention, attention_ref  # noqa: F401
