"""Staging kernels: the prefill gather and the decode scatter of KV head slices.

Installed as ``transfer_engine.kernels``. On CUDA tensors the entry points launch Triton kernels
(one launch for every layer, K and V); the staging side may be pinned host memory, which the
kernels read or write directly. On CPU tensors they run a vectorized torch reference, or the
Triton kernels under Triton's interpreter when ``TRITON_INTERPRET=1`` (how CI tests them).
"""

from ._common import (
    SUPPORTED_DTYPES,
    KernelInputError,
    KVTable,
    LaunchConfig,
    SlotIndex,
    as_kv_table,
    prepare_slots,
)
from .gather import gather_heads, gather_heads_reference
from .scatter import scatter_heads, scatter_heads_reference

__all__ = [
    "SUPPORTED_DTYPES",
    "KVTable",
    "KernelInputError",
    "LaunchConfig",
    "SlotIndex",
    "as_kv_table",
    "gather_heads",
    "gather_heads_reference",
    "prepare_slots",
    "scatter_heads",
    "scatter_heads_reference",
]
