"""Staging kernels are compiled when the engine starts, not on the loop while peers wait on it.

Triton compiles a kernel on its first launch for each set of compile-time constants. Those now
depend on the pool's layout and the head-slice width only, so the warm-up's one-token copies cover
rooms of every size. On a CUDA pool the test counts compilations; on CPU nothing is compiled.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from transfer_engine.kernels import as_kv_table, gather_heads, scatter_heads
from transfer_engine.kernels import gather as gather_module
from transfer_engine.kernels import scatter as scatter_module
from transfer_engine.memory.staging import head_counts, warm_staging_kernels

from .harness import DEVICE, make_pool, small_layout


@pytest.mark.parametrize(("heads", "expected"), [(1, [1]), (8, [1, 2, 4, 8]), (6, [1, 2, 3, 6]), (7, [1, 7])])
def test_head_counts_are_the_divisors(heads: int, expected: list[int]) -> None:
    assert head_counts(heads) == expected


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU case")
def test_nothing_is_compiled_for_a_cpu_pool() -> None:
    pool = make_pool("contiguous", small_layout(), 1, 0, 4)
    assert warm_staging_kernels(pool, scatter=True) == 0


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (TE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("kind", ["contiguous", "flash_hnd"])
def test_after_warm_up_no_room_size_compiles_a_kernel(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = make_pool(kind, small_layout(), 1, 0, 64)
    for t in pool.kv_views:
        t.copy_(torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16, device=t.device).view(t.dtype))
    before = [t.clone() for t in pool.kv_views]
    layout = small_layout()
    assert warm_staging_kernels(pool, scatter=True) == 2 * len(head_counts(layout.heads_local(1)))
    assert all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(before, pool.kv_views, strict=True)
    )
    compiled: list[str] = []
    for module, name in ((gather_module, "_gather_kernel"), (scatter_module, "_scatter_kernel")):
        kernel = getattr(module, name)
        real = kernel._do_compile

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            compiled.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(kernel, "_do_compile", counted)
    kv = as_kv_table(pool.kv_views)
    for tokens in (1, 3, 16, 17, 100, 127):  # slots 2i and 2i + 1 stay inside the 256-slot pool
        for n in head_counts(kv.heads):
            slots = torch.arange(tokens, dtype=torch.int64) * 2
            out = torch.empty(
                len(kv) * tokens * n * kv.head_dim * kv.itemsize, dtype=torch.uint8, device=pool.device
            )
            gather_heads(kv, slots, kv.heads - n, n, out)
            scatter_heads(out, kv, slots + 1, [(0, 0, n)])
    torch.cuda.synchronize()
    assert compiled == []
    # the count works: a buffer only 2-byte aligned is a new kernel (smaller copy unit)
    out = torch.empty(
        len(kv) * kv.heads * kv.head_dim * kv.itemsize + 2, dtype=torch.uint8, device=pool.device
    )
    gather_heads(kv, torch.zeros(1, dtype=torch.int64), 0, kv.heads, out[2:])
    torch.cuda.synchronize()
    assert compiled == ["_gather_kernel"]
