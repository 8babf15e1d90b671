"""Bad input raises KernelInputError before anything is launched; impl selection on CPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kvgen import make_pool, random_bytes

from transfer_engine.errors import ConfigError
from transfer_engine.kernels import (
    KernelInputError,
    LaunchConfig,
    gather_heads,
    prepare_slots,
    scatter_heads,
)
from transfer_engine.kernels import gather as gather_mod
from transfer_engine.kernels import scatter as scatter_mod

SLOTS, HEADS, DIM, TENSORS = 32, 4, 8, 4


def _forbid(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("launched")

    for name in names:
        for module in (gather_mod, scatter_mod):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, launched)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any kernel or reference run fails the test: errors must come first."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _forbid(monkeypatch, "triton_int", "gather_heads_reference", "scatter_heads_reference")


def _kv(dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    return make_pool(
        dtype,
        TENSORS,
        SLOTS,
        HEADS,
        DIM,
        style="separate",
        device="cpu",
        gen=torch.Generator().manual_seed(1),
    )


def _out(tokens: int, n: int = 2, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(TENSORS, tokens, n, DIM, dtype=dtype)


SLOTS_OK = torch.tensor([3, 1, 30], dtype=torch.int64)
REGION_BYTES = TENSORS * 3 * HEADS * DIM * 2


def _region() -> torch.Tensor:
    return random_bytes((REGION_BYTES,), torch.Generator().manual_seed(2))


BAD_GATHERS: dict[str, tuple[Callable[[], None], str]] = {
    "slot-too-large": (
        lambda: gather_heads(_kv(), torch.tensor([0, SLOTS]), 0, 2, _out(2)),
        f"slot {SLOTS} at position 1",
    ),
    "slot-negative": (
        lambda: gather_heads(_kv(), torch.tensor([5, -1, 2]), 0, 2, _out(3)),
        "slot -1 at position 1",
    ),
    "slots-float": (lambda: gather_heads(_kv(), torch.tensor([1.0]), 0, 2, _out(1)), "torch.float32"),
    "slots-2d": (lambda: gather_heads(_kv(), SLOTS_OK.view(1, 3), 0, 2, _out(3)), "(1, 3)"),
    "mixed-kv-dtypes": (
        lambda: gather_heads([*_kv()[:3], _kv(torch.float16)[0]], SLOTS_OK, 0, 2, _out(3)),
        "kv[3] has dtype torch.float16",
    ),
    "out-dtype": (lambda: gather_heads(_kv(), SLOTS_OK, 0, 2, _out(3, dtype=torch.float16)), "torch.float16"),
    "kv-last-dim-strided": (
        lambda: gather_heads(
            [
                t.transpose(1, 2)
                for t in make_pool(
                    torch.bfloat16,
                    TENSORS,
                    SLOTS,
                    DIM,
                    DIM,
                    style="separate",
                    device="cpu",
                    gen=torch.Generator(),
                )
            ],
            SLOTS_OK,
            0,
            2,
            _out(3),
        ),
        "stride 8 in its last dim",
    ),
    "out-not-contiguous": (lambda: gather_heads(_kv(), SLOTS_OK, 0, 2, _out(3, n=4)[:, :, :2]), "contiguous"),
    "out-wrong-shape": (
        lambda: gather_heads(_kv(), SLOTS_OK, 0, 2, _out(4)),
        "expected torch.bfloat16 (4, 3, 2, 8)",
    ),
    "out-bytes-too-small": (
        lambda: gather_heads(_kv(), SLOTS_OK, 0, 2, torch.zeros(100, dtype=torch.uint8)),
        "needs 384 bytes",
    ),
    "out-bytes-misaligned": (
        lambda: gather_heads(_kv(), SLOTS_OK, 0, 2, torch.zeros(1000, dtype=torch.uint8)[1:]),
        "not aligned to torch.bfloat16 items",
    ),
    "heads-past-end": (lambda: gather_heads(_kv(), SLOTS_OK, 3, 2, _out(3)), "heads [3, 5)"),
    "zero-heads": (lambda: gather_heads(_kv(), SLOTS_OK, 0, 0, _out(3, n=0)), "head count 0"),
    "kv-shapes-differ": (
        lambda: gather_heads([*_kv()[:3], _kv()[0][:16]], SLOTS_OK, 0, 2, _out(3)),
        "kv[3] has shape (16, 4, 8)",
    ),
    "kv-empty": (lambda: gather_heads([], SLOTS_OK, 0, 2, _out(3)), "non-empty sequence"),
    "kv-unsupported-dtype": (
        lambda: gather_heads(
            [torch.zeros(4, 1, 2, dtype=torch.float64)],
            SLOTS_OK[:1],
            0,
            1,
            torch.zeros(1, 1, 1, 2, dtype=torch.float64),
        ),
        "float64 is not supported",
    ),
    "impl-unknown": (lambda: gather_heads(_kv(), SLOTS_OK, 0, 2, _out(3), impl="cuda"), "impl='cuda'"),  # type: ignore[arg-type]
    "stream-on-cpu": (lambda: gather_heads(_kv(), SLOTS_OK, 0, 2, _out(3), stream=object()), "CUDA stream"),  # type: ignore[arg-type]
}

BAD_SCATTERS: dict[str, tuple[Callable[[], None], str]] = {
    "slot-too-large": (
        lambda: scatter_heads(_region(), _kv(), torch.tensor([1, 2, SLOTS + 5]), [(0, 0, 4)]),
        f"slot {SLOTS + 5} at position 2",
    ),
    "region-dtype": (
        lambda: scatter_heads(_region().view(torch.float16), _kv(), SLOTS_OK, [(0, 0, 4)]),
        "torch.float16",
    ),
    "region-not-contiguous": (
        lambda: scatter_heads(_region().view(-1, 2)[:, 0], _kv(), SLOTS_OK, [(0, 0, 4)]),
        "contiguous",
    ),
    "block-past-region": (
        lambda: scatter_heads(_region(), _kv(), SLOTS_OK, [(2, 0, 4)]),
        "offset 2 (+768 bytes)",
    ),
    "block-misaligned": (lambda: scatter_heads(_region(), _kv(), SLOTS_OK, [(1, 0, 1)]), "offset 1"),
    "blocks-overlap-heads": (
        lambda: scatter_heads(_region(), _kv(), SLOTS_OK, [(0, 0, 2), (384, 1, 2)]),
        "overlapping destination heads",
    ),
    "blocks-overlap-region": (
        lambda: scatter_heads(_region(), _kv(), SLOTS_OK, [(0, 0, 2), (190, 2, 2)]),
        "overlap in the region",
    ),
    "blocks-empty": (lambda: scatter_heads(_region(), _kv(), SLOTS_OK, []), "non-empty sequence"),
    "block-not-ints": (lambda: scatter_heads(_region(), _kv(), SLOTS_OK, [(0.0, 0, 4)]), "blocks[0]"),  # type: ignore[list-item]
    "block-heads-past-end": (lambda: scatter_heads(_region(), _kv(), SLOTS_OK, [(0, 3, 2)]), "heads [3, 5)"),
}


@pytest.mark.parametrize("name", list(BAD_GATHERS))
def test_bad_gather_raises_before_launch(no_launch: None, name: str) -> None:
    call, message = BAD_GATHERS[name]
    with pytest.raises(KernelInputError) as info:
        call()
    assert message in str(info.value)
    assert isinstance(info.value, ConfigError)


@pytest.mark.parametrize("name", list(BAD_SCATTERS))
def test_bad_scatter_raises_before_launch(no_launch: None, name: str) -> None:
    call, message = BAD_SCATTERS[name]
    with pytest.raises(KernelInputError) as info:
        call()
    assert message in str(info.value)


def test_rejected_gather_leaves_out_untouched(no_launch: None) -> None:
    out = _out(3).fill_(7)
    with pytest.raises(KernelInputError):
        gather_heads(_kv(), torch.tensor([1, 2, 99]), 0, 2, out)
    assert torch.equal(out, torch.full_like(out, 7))


def test_rejected_scatter_leaves_kv_untouched(no_launch: None) -> None:
    kv = _kv()
    before = [t.clone() for t in kv]
    with pytest.raises(KernelInputError):
        scatter_heads(_region(), kv, torch.tensor([1, 2, 99]), [(0, 0, 4)])
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(kv, before, strict=True))


def test_slot_index_checked_against_each_pool() -> None:
    index = prepare_slots(torch.tensor([0, 17]), 32, torch.device("cpu"))
    small = make_pool(torch.bfloat16, 2, 16, 1, 8, style="separate", device="cpu", gen=torch.Generator())
    with pytest.raises(KernelInputError, match="slot 17 is outside the KV pool"):
        gather_heads(small, index, 0, 1, torch.zeros(2, 2, 1, 8, dtype=torch.bfloat16))


def test_launch_config_checked() -> None:
    with pytest.raises(KernelInputError, match="block_bytes=100"):
        LaunchConfig(block_bytes=100)
    with pytest.raises(KernelInputError, match="num_warps=3"):
        LaunchConfig(num_warps=3)


def test_interpret_env_runs_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """With TRITON_INTERPRET=1 and impl="auto", CPU tensors go through the kernels, not the reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _forbid(monkeypatch, "gather_heads_reference", "scatter_heads_reference")
    kv, out = _kv(), _out(3)
    gather_heads(kv, SLOTS_OK, 1, 2, out)
    assert torch.equal(out.view(torch.int16), torch.stack([t.view(torch.int16)[SLOTS_OK, 1:3] for t in kv]))
    scatter_heads(out, kv, torch.tensor([5, 6, 7]), [(0, 2, 2)])
    assert all(
        torch.equal(t[5:8, 2:4].view(torch.int16), o.view(torch.int16)) for t, o in zip(kv, out, strict=True)
    )


def test_cpu_without_interpret_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _forbid(monkeypatch, "triton_int")
    kv, out = _kv(), _out(3)
    gather_heads(kv, SLOTS_OK, 0, 2, out)
    assert torch.equal(out.view(torch.int16), torch.stack([t.view(torch.int16)[SLOTS_OK, 0:2] for t in kv]))


def test_block_tables_are_uploaded_once_per_layout_and_the_cache_is_bounded() -> None:
    from transfer_engine.kernels import _common

    device = torch.device("cpu")
    rows = ((0, 0, 4), (1024, 4, 4))
    first = _common.block_table(rows, device)
    assert first.tolist() == [list(r) for r in rows] and first.dtype == torch.int64
    assert _common.block_table(rows, device) is first  # a hit: nothing made again
    other = _common.block_table(((0, 0, 8),), device)
    assert other is not first and other.tolist() == [[0, 0, 8]]
    for i in range(_common._BLOCK_TABLE_CACHE_SIZE + 1):
        _common.block_table(((i, 0, 1),), device)
    assert len(_common._BLOCK_TABLES) == _common._BLOCK_TABLE_CACHE_SIZE
    assert _common.block_table(rows, device) is not first  # evicted, made again
