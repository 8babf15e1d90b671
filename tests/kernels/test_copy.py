"""The indexed entry copy (kernels/copy.py): bit-exact against its torch reference and against plain
per-token indexing of the pools' views, over dtypes (fp8 and bytes included), page sizes 1 and 16,
head slices (hetero TP), contiguous and strided (FlashAttention NHD/HND) layouts, whole chunks and
layer groups, on a non-default stream on CUDA.

The tables and indices come from ``protocol.tables`` exactly as the kernel path makes them (entry
addresses of every page once per pair, int32 indices per copy); the expectation never calls them.

The copy that sums what it copies (integrity, ``copy_entries(checksum=..., order=...)``): its sum is
the checksum's definition (``checksum_numpy``) over the chunk's gather layout built here by plain
indexing, and the decode's check over the destination pages (``checksum_heads``), over layouts whose
entries are a head, a token's heads, a page, K and V side by side, and every layer of a block; whole
chunks and layer groups, head slices, a chunk starting inside the request; and over raw orders
(8-byte units whose runs split them, units under 4 bytes, which the reference sums).
"""

from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from transfer_engine.actors.worker.kernel import gather_order
from transfer_engine.kernels import KernelInputError
from transfer_engine.kernels.checksum import MASK64, checksum_heads, checksum_numpy, checksum_value
from transfer_engine.kernels.copy import (
    WordOrder,
    copy_entries,
    copy_entries_reference,
    copy_outer,
    entry_table,
    view_starts,
)
from transfer_engine.protocol import tables

DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8]


@dataclass(frozen=True)
class Where:
    name: str
    device: str
    impl: str


WHERE = [
    pytest.param(Where("interp", "cpu", "triton"), id="interp"),
    pytest.param(Where("torch", "cpu", "torch"), id="torch"),
    pytest.param(Where("cuda", "cuda", "auto"), id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=WHERE)
def where(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Where:
    chosen: Where = request.param
    if chosen.name == "interp":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return chosen


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs, negative zeros and fp8 codes included)."""
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * torch.empty((), dtype=dtype).element_size()),
                        dtype=torch.uint8, generator=gen)  # fmt: skip
    return raw.view(dtype)


@dataclass
class Side:
    """One side's KV: its memory tensors, the per-tensor views ``[pages, page, heads, dim]``, strides rows."""

    memory: list[torch.Tensor]
    views: list[torch.Tensor]
    rows: np.ndarray
    page_size: int
    heads: int

    @property
    def bases(self) -> np.ndarray:
        return np.array([t.data_ptr() for t in self.memory], dtype=np.uint64)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([t.numel() * t.element_size() for t in self.memory], dtype=np.uint64)


def _side(kind: str, layers: int, pages: int, page: int, heads: int, dim: int, dtype: torch.dtype,
          device: str, gen: torch.Generator) -> Side:  # fmt: skip
    """KV of ``kind``: "contiguous" (one ``[slots, heads, dim]`` tensor per K and V), "nhd" / "hnd"
    (per layer one ``(2, pages, page, heads, dim)`` / ``(2, pages, heads, page, dim)`` tensor),
    "vllm_cpu" (per layer ``(pages, heads, page, 2 * dim)``: a head's K and V side by side) or
    "blocks" (one ``(pages, layers, 2, page, heads, dim)`` tensor: a page holds every layer)."""
    item = torch.empty((), dtype=dtype).element_size()
    memory: list[torch.Tensor] = []
    views: list[torch.Tensor] = []
    if kind == "contiguous":
        memory = [_random((pages * page, heads, dim), dtype, gen).to(device) for _ in range(2 * layers)]
        views = [t.view(pages, page, heads, dim) for t in memory]
    elif kind == "vllm_cpu":
        memory = [_random((pages, heads, page, 2 * dim), dtype, gen).to(device) for _ in range(layers)]
        per = [m.permute(0, 2, 1, 3) for m in memory]
        views = [p[..., :dim] for p in per] + [p[..., dim:] for p in per]
    elif kind == "blocks":
        memory = [_random((pages, layers, 2, page, heads, dim), dtype, gen).to(device)]
        views = [memory[0][:, i, 0] for i in range(layers)] + [memory[0][:, i, 1] for i in range(layers)]
    else:
        shape = (2, pages, page, heads, dim) if kind == "nhd" else (2, pages, heads, page, dim)
        memory = [_random(shape, dtype, gen).to(device) for _ in range(layers)]
        per = [m if kind == "nhd" else m.permute(0, 1, 3, 2, 4) for m in memory]
        views = [p[0] for p in per] + [p[1] for p in per]
    rows = []
    for v in views:
        region = next(
            i for i, m in enumerate(memory) if m.data_ptr() <= v.data_ptr() < m.data_ptr() + m.numel() * item
        )
        rows.append((region, v.data_ptr() - memory[region].data_ptr(), v.stride(0) * item,
                     v.stride(2) * item, v.stride(1) * item))  # fmt: skip
    return Side(memory, views, np.array(rows, dtype=np.int64), page, heads)


def _expect(src: Side, dst: Side, src_pages: list[int], dst_pages: list[int], tokens: int, h0: tuple[int, int],
            nh: int, tensors: list[int], before: list[torch.Tensor]) -> list[torch.Tensor]:  # fmt: skip
    """The destination views after the copy, by plain per-token indexing of byte views."""
    out = [b.clone().view(torch.uint8) for b in before]
    for t in tensors:
        s = src.views[t].view(torch.uint8)
        for i in range(tokens):
            sp, so = src_pages[i // src.page_size], i % src.page_size
            dp, do = dst_pages[i // dst.page_size], i % dst.page_size
            out[t][dp, do, h0[1] : h0[1] + nh] = s[sp, so, h0[0] : h0[0] + nh]
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).contiguous().cpu()


CASES = [
    # (src kind, dst kind, src page, dst page, src heads, dst heads, src head start, dst head start, heads moved)
    pytest.param("contiguous", "contiguous", 16, 16, 4, 4, 0, 0, 4, id="contig-16"),
    pytest.param("contiguous", "contiguous", 1, 1, 4, 4, 0, 0, 4, id="contig-1"),
    pytest.param("nhd", "nhd", 16, 16, 4, 4, 0, 0, 4, id="nhd-16"),
    pytest.param("hnd", "nhd", 16, 4, 4, 4, 0, 0, 4, id="hnd-to-nhd-unequal-pages"),
    pytest.param("nhd", "contiguous", 16, 1, 4, 2, 2, 0, 2, id="nhd-slice-hetero-tp"),
    pytest.param("contiguous", "hnd", 4, 16, 2, 4, 0, 2, 2, id="contig-into-hnd-slice"),
]


FORMS = ["indices", "factors"]
"""How a test hands its copy to the kernel: ``copy_entries`` of ``write_indices``' index arrays, or
``copy_outer`` of ``write_factors``' factors (the kernel path's plain copies)."""


def _copy(form: str, s_table: object, d_table: object, spec: tables.TableSpec, src_pages: list[int],
          dst_pages: list[int], rows: object = None, **kw: object) -> None:  # fmt: skip
    if form == "indices":
        s_idx, d_idx = tables.write_indices(spec, src_pages, dst_pages, rows)  # type: ignore[arg-type]
        copy_entries(s_table, d_table, s_idx, d_idx, **kw)  # type: ignore[arg-type]
    else:
        copy_outer(s_table, d_table, *tables.write_factors(spec, src_pages, dst_pages, rows), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("sk", "dk", "sps", "dps", "sh", "dh", "s0", "d0", "nh"), CASES)
def test_copy_matches_indexing(where: Where, dtype: torch.dtype, sk: str, dk: str, sps: int, dps: int,
                               sh: int, dh: int, s0: int, d0: int, nh: int, form: str) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(zlib.crc32(f"{sk}{dk}{sps}{dps}{dtype}".encode()))
    layers, dim = 2, 8
    src = _side(sk, layers, 6 * 16 // sps, sps, sh, dim, dtype, where.device, gen)
    dst = _side(dk, layers, 6 * 16 // dps, dps, dh, dim, dtype, where.device, gen)
    head_bytes = dim * torch.empty((), dtype=dtype).element_size()
    spec = tables.decide_table(src.rows, dst.rows, head_bytes, sps, dps, s0, d0, nh, sh, dh)
    s_addr, _ = tables.side_entries(spec, "src", src.bases, src.lengths, src.rows, len(src.views[0]))
    d_addr, _ = tables.side_entries(spec, "dst", dst.bases, dst.lengths, dst.rows, len(dst.views[0]))
    s_table = entry_table(s_addr, spec.entry_bytes, where.device)
    d_table = entry_table(d_addr, spec.entry_bytes, where.device)
    rng = np.random.default_rng(7)
    tokens = 32
    src_pages = rng.permutation(len(src.views[0]))[: tokens // sps].tolist()
    dst_pages = rng.permutation(len(dst.views[0]))[: tokens // dps].tolist()
    before = [v.clone() for v in dst.views]
    stream = torch.cuda.Stream() if where.device == "cuda" else None
    _copy(form, s_table, d_table, spec, src_pages, dst_pages, stream=stream, impl=where.impl)
    if stream is not None:
        stream.synchronize()
    want = _expect(src, dst, src_pages, dst_pages, tokens, (s0, d0), nh, list(range(2 * layers)), before)
    for t in range(2 * layers):
        assert torch.equal(_bytes(dst.views[t]), _bytes(want[t])), f"tensor {t}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_layer_group_moves_its_tensors_only(where: Where, dtype: torch.dtype, form: str) -> None:
    """A layer group's indices (``rows``) copy its layers' K and V and nothing else."""
    gen = torch.Generator().manual_seed(3)
    layers, dim, ps = 4, 8, 16
    src = _side("nhd", layers, 4, ps, 2, dim, dtype, where.device, gen)
    dst = _side("nhd", layers, 4, ps, 2, dim, dtype, where.device, gen)
    head_bytes = dim * torch.empty((), dtype=dtype).element_size()
    spec = tables.decide_table(src.rows, dst.rows, head_bytes, ps, ps, 0, 0, 2, 2, 2, group_layers=2)
    s_addr, _ = tables.side_entries(spec, "src", src.bases, src.lengths, src.rows, 4)
    d_addr, _ = tables.side_entries(spec, "dst", dst.bases, dst.lengths, dst.rows, 4)
    group = [2, 3, layers + 2, layers + 3]  # layers [2, 4): their K and V rows
    before = [v.clone() for v in dst.views]
    _copy(form, entry_table(s_addr, spec.entry_bytes, where.device), entry_table(d_addr, spec.entry_bytes, where.device),
          spec, [1, 3], [2, 0], np.array(group), impl=where.impl)  # fmt: skip
    if where.device == "cuda":
        torch.cuda.synchronize()
    want = _expect(src, dst, [1, 3], [2, 0], 2 * ps, (0, 0), 2, group, before)
    for t in range(2 * layers):
        assert torch.equal(_bytes(dst.views[t]), _bytes(want[t])), f"tensor {t}"


@pytest.mark.parametrize("entry_bytes", [1, 3, 6, 16, 48, 2048 + 24, 40000], ids=lambda b: f"{b}B")
def test_kernel_matches_reference(where: Where, entry_bytes: int) -> None:
    """Raw tables of any entry size (1-, 2-, 8-byte units, masked and multi-piece entries) and
    permuted indices: the kernel writes exactly what the reference writes."""
    gen = torch.Generator().manual_seed(entry_bytes)
    n = 24
    src = torch.randint(0, 256, (n * entry_bytes,), dtype=torch.uint8, generator=gen).to(where.device)
    outs = [torch.zeros(n * entry_bytes + 7, dtype=torch.uint8, device=where.device) for _ in range(2)]
    rng = np.random.default_rng(entry_bytes)
    s_idx = rng.permutation(n)[:17]
    d_idx = rng.permutation(n)[:17]
    s_table = entry_table(
        src.data_ptr() + np.arange(n, dtype=np.uint64) * entry_bytes, entry_bytes, where.device
    )
    for out, run in zip(outs, (copy_entries, copy_entries_reference), strict=True):
        # dst entries start 1 byte into the buffer: an odd alignment the kernel must honour
        d_table = entry_table(out.data_ptr() + 1 + np.arange(n, dtype=np.uint64) * entry_bytes, entry_bytes,
                              where.device)  # fmt: skip
        if run is copy_entries:
            copy_entries(s_table, d_table, s_idx, d_idx, impl=where.impl)  # type: ignore[arg-type]
        else:
            copy_entries_reference(s_table, d_table, s_idx, d_idx)
    if where.device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(outs[0].cpu(), outs[1].cpu())
    got = outs[0].cpu()[1:].view(-1)[: n * entry_bytes].view(n, entry_bytes)
    for s, d in zip(s_idx, d_idx, strict=True):
        assert torch.equal(got[d], src.cpu().view(n, entry_bytes)[s])
    untouched = sorted(set(range(n)) - set(d_idx.tolist()))
    assert int(got[untouched].count_nonzero()) == 0


def test_empty_copy_launches_nothing(where: Where) -> None:
    buf = torch.zeros(64, dtype=torch.uint8, device=where.device)
    table = entry_table(buf.data_ptr() + np.arange(4, dtype=np.uint64) * 16, 16, where.device)
    copy_entries(table, table, np.zeros(0, np.int32), np.zeros(0, np.int32), impl=where.impl)  # type: ignore[arg-type]
    assert int(buf.count_nonzero()) == 0


@pytest.mark.parametrize(
    ("src_idx", "dst_idx", "match"),
    [
        ([0, 4], [0, 1], "src_idx holds 4"),
        ([0, 1], [-1, 1], "dst_idx holds -1"),
        # int32, the engine's indices: one unsigned pass sees a negative index as out of range
        (np.array([0, 4], np.int32), np.array([0, 1], np.int32), "src_idx holds 4"),
        (np.array([0, 1], np.int32), np.array([-1, 1], np.int32), "dst_idx holds -1"),
        (np.array([0, 1], np.int32), np.array([-(2**31), 1], np.int32), "dst_idx holds -2147483648"),
        ([0, 1], [0], "src_idx has 2 entries, dst_idx 1"),
        ([[0]], [[0]], "1-D integer array"),
        ([0.5], [0], "1-D integer array"),
    ],
)
def test_bad_indices_raise_before_launch(src_idx: object, dst_idx: object, match: str) -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    table = entry_table(buf.data_ptr() + np.arange(4, dtype=np.uint64) * 16, 16, "cpu")
    with pytest.raises(KernelInputError, match=match):
        copy_entries(table, table, src_idx, dst_idx)  # type: ignore[arg-type]
    assert int(buf.count_nonzero()) == 0


@pytest.mark.parametrize(
    ("offsets", "src_cols", "dst_cols", "match"),
    [
        ([0, 2], [0, 2], [0, 1], "src entry 4 .* outside the table's \\[0, 4\\)"),
        ([0, 1], [0, 1], [-2, 0], "dst entry -2"),
        ([0], [0, 1], [0], "src_cols has 2 entries, dst_cols 1"),
        ([[0]], [0], [0], "offsets must be a 1-D integer array"),
        ([0], [0.5], [0], "src_cols must be a 1-D integer array"),
    ],
)
def test_bad_factors_raise_before_launch(
    offsets: object, src_cols: object, dst_cols: object, match: str
) -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    table = entry_table(buf.data_ptr() + np.arange(4, dtype=np.uint64) * 16, 16, "cpu")
    with pytest.raises(KernelInputError, match=match):
        copy_outer(table, table, offsets, src_cols, dst_cols)  # type: ignore[arg-type]
    assert int(buf.count_nonzero()) == 0


def test_bad_tables_raise() -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    addr = buf.data_ptr() + np.arange(4, dtype=np.uint64) * 16
    with pytest.raises(KernelInputError, match="non-empty 1-D"):
        entry_table(np.zeros(0, np.uint64), 16, "cpu")
    with pytest.raises(KernelInputError, match="address 0"):
        entry_table(np.array([0, 16], np.uint64), 16, "cpu")
    with pytest.raises(KernelInputError, match="entry_bytes"):
        entry_table(addr, 0, "cpu")
    with pytest.raises(KernelInputError, match="src entries are 16 bytes, dst entries 8"):
        copy_entries(entry_table(addr, 16, "cpu"), entry_table(addr, 8, "cpu"), [0], [0])
    with pytest.raises(KernelInputError, match="a CUDA stream was given"):
        copy_entries(entry_table(addr, 16, "cpu"), entry_table(addr, 16, "cpu"), [0], [1],
                     stream=torch.cuda.Stream() if torch.cuda.is_available() else object())  # type: ignore[arg-type]  # fmt: skip


def test_alignment_of_a_table() -> None:
    """``align``: the largest power of two (<= 16) dividing every address and the entry size."""
    assert entry_table(np.array([64, 128], np.uint64), 256, "cpu").align == 16
    assert entry_table(np.array([64, 132], np.uint64), 256, "cpu").align == 4
    assert entry_table(np.array([64, 128], np.uint64), 6, "cpu").align == 2


@pytest.mark.gpu
def test_copy_never_synchronizes() -> None:
    """With sync debug mode "error", any synchronising CUDA call inside the wrapper raises."""
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    s_table = entry_table(src.data_ptr() + np.arange(256, dtype=np.uint64) * 4096, 4096, "cuda")
    d_table = entry_table(dst.data_ptr() + np.arange(256, dtype=np.uint64) * 4096, 4096, "cuda")
    stream = torch.cuda.Stream()
    perm = np.random.default_rng(0).permutation(256).astype(np.int32)
    copy_entries(s_table, d_table, perm, perm, stream=stream)  # compiles and uploads the tables
    stream.synchronize()
    # torch warns that the mode is a prototype; with warnings as errors that warning would raise with
    # the mode already set, and leave every later test of the session failing on its own syncs
    prototype = "Synchronization debug mode is a prototype"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", prototype, UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", prototype, UserWarning)
            copy_entries(s_table, d_table, perm[::-1].copy(), perm, stream=stream)
    finally:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", prototype, UserWarning)
            torch.cuda.set_sync_debug_mode("default")
    stream.synchronize()
    want = src.view(256, 4096)[torch.from_numpy(perm[::-1].copy()).long().cuda()]
    assert torch.equal(dst.view(256, 4096)[torch.from_numpy(perm).long().cuda()], want)


def _gather_layout(side: Side, pages: list[int], tokens: int, h0: int, nh: int, rows: list[int]) -> bytes:
    """The bytes ``gather_heads`` would write for a chunk of ``tokens`` from the start of ``pages``:
    ``[T, tokens, nh, dim]`` over the tensors ``rows`` in that order, by plain per-token indexing."""
    parts = []
    for t in rows:
        view = side.views[t].view(torch.uint8)
        for i in range(tokens):
            parts.append(view[pages[i // side.page_size], i % side.page_size, h0 : h0 + nh].cpu())
    return torch.stack(parts).numpy().tobytes()


SUM_CASES = [
    # (src kind, dst kind, src page, dst page, src heads, dst heads, src head start, dst head start, heads moved)
    pytest.param("contiguous", "contiguous", 16, 16, 4, 4, 0, 0, 4, id="contig-page"),
    pytest.param("hnd", "nhd", 16, 4, 4, 4, 0, 0, 4, id="hnd-to-nhd-head"),
    pytest.param("nhd", "contiguous", 16, 1, 4, 2, 2, 0, 2, id="nhd-slice-token"),
    pytest.param("contiguous", "hnd", 4, 16, 2, 4, 0, 2, 2, id="contig-into-hnd-slice"),
    pytest.param("vllm_cpu", "vllm_cpu", 4, 4, 2, 2, 0, 0, 2, id="vllm-kv-fused"),
    pytest.param("blocks", "blocks", 4, 4, 2, 2, 0, 0, 2, id="blocks-every-layer"),
    pytest.param("blocks", "blocks", 4, 4, 4, 2, 2, 0, 2, id="blocks-slice"),
]


@pytest.mark.parametrize("group", [None, (2, 4)], ids=["chunk", "layers-2-4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=str)
@pytest.mark.parametrize(("sk", "dk", "sps", "dps", "sh", "dh", "s0", "d0", "nh"), SUM_CASES)
def test_fused_sum_is_the_checksum_of_the_gather_layout(where: Where, dtype: torch.dtype, sk: str, dk: str,
                                                        sps: int, dps: int, sh: int, dh: int, s0: int, d0: int,
                                                        nh: int, group: tuple[int, int] | None) -> None:  # fmt: skip
    """A chunk (or layer group) copied with its sum, as the kernel path copies it: the sum equals the
    checksum's definition over the writer's gather layout and the decode's check over the pages it
    landed in (so the decode compares equal), equals the reference's, and the bytes are exact."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"sum{sk}{dk}{sps}{dps}{sh}{dtype}{group}".encode()))
    layers, dim = 4, 8
    src = _side(sk, layers, 64 // sps, sps, sh, dim, dtype, where.device, gen)
    dst = _side(dk, layers, 64 // dps, dps, dh, dim, dtype, where.device, gen)
    head_bytes = dim * torch.empty((), dtype=dtype).element_size()
    spec = tables.decide_table(src.rows, dst.rows, head_bytes, sps, dps, s0, d0, nh, sh, dh,
                               group_layers=None if group is None else group[1] - group[0])  # fmt: skip
    s_addr, _ = tables.side_entries(spec, "src", src.bases, src.lengths, src.rows, len(src.views[0]))
    d_addr, _ = tables.side_entries(spec, "dst", dst.bases, dst.lengths, dst.rows, len(dst.views[0]))
    s_table = entry_table(s_addr, spec.entry_bytes, where.device)
    d_table = entry_table(d_addr, spec.entry_bytes, where.device)
    rng = np.random.default_rng(11)
    start, tokens = 16, 32  # the request's second chunk: tokens [16, 48) of 48
    src_pages = rng.permutation(len(src.views[0]))[: tokens // sps].tolist()
    dst_pages = rng.permutation(len(dst.views[0]))[: (start + tokens) // dps].tolist()
    rows = (
        list(range(2 * layers)) if group is None else [*range(*group), *(layers + r for r in range(*group))]
    )
    picked = None if group is None else np.array(rows)
    s_idx, d_idx = tables.write_indices(spec, src_pages, dst_pages, picked, dst_start_token=start,
                                        num_tokens=tokens)  # fmt: skip
    order = gather_order(spec, picked, tokens)
    before = [v.clone() for v in dst.views]
    stream = torch.cuda.Stream() if where.device == "cuda" else None
    out = torch.full((1,), -1, dtype=torch.int64, pin_memory=where.device == "cuda")
    copy_entries(s_table, d_table, s_idx, d_idx, stream=stream, impl=where.impl, checksum=out, order=order)
    if stream is not None:
        stream.synchronize()
    summed = checksum_value(out)
    want = checksum_numpy(_gather_layout(src, src_pages, tokens, s0, nh, rows))
    assert summed == want
    slots = torch.tensor([dst_pages[(start + i) // dps] * dps + (start + i) % dps for i in range(tokens)])
    landed = checksum_heads([dst.views[t] for t in rows], slots, d0, nh,
                            impl="auto" if where.device == "cuda" else "torch")  # fmt: skip
    assert checksum_value(landed) == want
    for t in range(2 * layers):  # bytes exact: the chunk's tokens of the group's tensors, nothing else
        expect = before[t].clone().view(torch.uint8)
        if t in rows:
            s = src.views[t].view(torch.uint8)
            for i in range(tokens):
                q = start + i
                expect[dst_pages[q // dps], q % dps, d0 : d0 + nh] = s[
                    src_pages[i // sps], i % sps, s0 : s0 + nh
                ]
        assert torch.equal(_bytes(dst.views[t]), _bytes(expect)), f"tensor {t}"
    for v, b in zip(dst.views, before, strict=True):
        v.copy_(b)
    reference = copy_entries_reference(s_table, d_table, s_idx, d_idx, order=order)
    assert reference is not None and checksum_value(reference) == want
    # the kernel path's own form: the copy and its order as factors (write_factors, gather_order)
    factors = tables.write_factors(
        spec, src_pages, dst_pages, picked, dst_start_token=start, num_tokens=tokens
    )
    again = torch.full((1,), -1, dtype=torch.int64, pin_memory=where.device == "cuda")
    copy_outer(s_table, d_table, *factors, stream=stream, impl=where.impl, checksum=again, order=order)
    if stream is not None:
        stream.synchronize()
    assert checksum_value(again) == want


@pytest.mark.parametrize("group", [None, (2, 4)], ids=["chunk", "layers-2-4"])
def test_fused_sum_of_latents(where: Where, group: tuple[int, int] | None) -> None:
    """MLA: one latent per layer (``[C_0..C_{L-1}]``, one head), whole chunks and layer groups."""
    gen = torch.Generator().manual_seed(5)
    latents, dim, ps = 8, 16, 4
    src = _side("contiguous", latents // 2, 16, ps, 1, dim, torch.bfloat16, where.device, gen)
    dst = _side("contiguous", latents // 2, 16, ps, 1, dim, torch.bfloat16, where.device, gen)
    spec = tables.decide_table(src.rows, dst.rows, 2 * dim, ps, ps, 0, 0, 1, 1, 1, mla=True,
                               group_layers=None if group is None else group[1] - group[0])  # fmt: skip
    s_table = entry_table(tables.side_entries(spec, "src", src.bases, src.lengths, src.rows, 16)[0],
                          spec.entry_bytes, where.device)  # fmt: skip
    d_table = entry_table(tables.side_entries(spec, "dst", dst.bases, dst.lengths, dst.rows, 16)[0],
                          spec.entry_bytes, where.device)  # fmt: skip
    rows = list(range(latents)) if group is None else list(range(*group))
    picked = None if group is None else np.array(rows)
    s_idx, d_idx = tables.write_indices(spec, [3, 1, 4], [5, 9, 2], picked)
    out = torch.zeros(1, dtype=torch.int64, pin_memory=where.device == "cuda")
    copy_entries(s_table, d_table, s_idx, d_idx, impl=where.impl, checksum=out,
                 order=gather_order(spec, picked, 12))  # fmt: skip
    if where.device == "cuda":
        torch.cuda.synchronize()
    assert checksum_value(out) == checksum_numpy(_gather_layout(src, [3, 1, 4], 12, 0, 1, rows))


def _defined_sum(src: torch.Tensor, entry_bytes: int, s_idx: np.ndarray, order: WordOrder) -> int:
    """The definition with every word's position written out: ``sum((pos + 1) * w) mod 2**64``."""
    words = src.cpu().numpy().view("<u4").reshape(-1, entry_bytes // 4)[s_idx].astype(np.uint64)
    pos = order.entry_first()[:, None] + order.offsets()[None, :]
    return int((words * (pos + 1).astype(np.uint64)).sum(dtype=np.uint64)) & MASK64


ORDERS = [
    # (entry bytes, dst byte offset (alignment), run words, dims)
    pytest.param(48, 0, 12, (), id="one-run"),
    pytest.param(48, 0, 2, ((3, 40), (2, 7)), id="runs-of-8B"),
    pytest.param(24, 0, 3, ((2, 100),), id="8B-units-split-by-runs"),
    pytest.param(96, 0, 1, ((2, 5), (3, 50), (2, 1000), (2, 9)), id="four-dims"),
    pytest.param(2048 + 32, 0, 8, ((65, 16),), id="multi-piece"),
    pytest.param(32, 0, 4, ((2, 1 << 33),), id="wide-weights"),
    pytest.param(48, 2, 4, ((3, 10),), id="2B-aligned-dst-reference"),
    pytest.param(48, 1, 4, ((3, 10),), id="1B-aligned-dst-reference"),
]


@pytest.mark.parametrize(("entry_bytes", "offset", "run", "dims"), ORDERS)
def test_fused_sum_over_raw_orders(where: Where, entry_bytes: int, offset: int, run: int,
                                   dims: tuple[tuple[int, int], ...]) -> None:  # fmt: skip
    """Any order (4- and 8-byte units, runs splitting 8-byte units, four dims, masked pieces, and
    units under 4 bytes summed by the reference): the sum is the definition, the bytes the copy's."""
    gen = torch.Generator().manual_seed(entry_bytes + offset)
    n = 24
    src = torch.randint(0, 256, (n * entry_bytes,), dtype=torch.uint8, generator=gen).to(where.device)
    out = torch.zeros(n * entry_bytes + 16, dtype=torch.uint8, device=where.device)
    rng = np.random.default_rng(entry_bytes)
    s_idx, d_idx = rng.permutation(n)[:17], rng.permutation(n)[:17]
    order = WordOrder(rng.integers(0, 1 << 40, 17).astype(np.int64), run, dims)
    s_table = entry_table(
        src.data_ptr() + np.arange(n, dtype=np.uint64) * entry_bytes, entry_bytes, where.device
    )
    d_table = entry_table(out.data_ptr() + offset + np.arange(n, dtype=np.uint64) * entry_bytes, entry_bytes,
                          where.device)  # fmt: skip
    summed = torch.zeros(1, dtype=torch.int64, device=where.device)
    copy_entries(s_table, d_table, s_idx, d_idx, impl=where.impl, checksum=summed, order=order)
    want = _defined_sum(src, entry_bytes, s_idx, order)
    assert checksum_value(summed) == want
    got = out.cpu()[offset:][: n * entry_bytes].view(n, entry_bytes)
    for s, d in zip(s_idx, d_idx, strict=True):
        assert torch.equal(got[d], src.cpu().view(n, entry_bytes)[s])
    reference = copy_entries_reference(s_table, d_table, s_idx, d_idx, order=order)
    assert reference is not None and checksum_value(reference) == want


@pytest.mark.parametrize(("entry_bytes", "run", "dims"), [(48, 12, ()), (64, 2, ((4, 9), (2, 1000)))])
def test_summed_copy_from_factors(where: Where, entry_bytes: int, run: int,
                                  dims: tuple[tuple[int, int], ...]) -> None:  # fmt: skip
    """The kernel path's summed copy: the copy and its order both given as factors (``copy_outer``,
    ``WordOrder.cols``): the bytes of the outer sums' copy, the sum of the definition over every
    entry's first position ``first[u] + cols[j]``."""
    gen = torch.Generator().manual_seed(entry_bytes)
    n = 40
    src = torch.randint(0, 256, (n * entry_bytes,), dtype=torch.uint8, generator=gen).to(where.device)
    out = torch.zeros(n * entry_bytes, dtype=torch.uint8, device=where.device)
    s_table = entry_table(src.data_ptr() + np.arange(n, dtype=np.uint64) * entry_bytes, entry_bytes,
                          where.device)  # fmt: skip
    d_table = entry_table(out.data_ptr() + np.arange(n, dtype=np.uint64) * entry_bytes, entry_bytes,
                          where.device)  # fmt: skip
    offsets = np.array([0, 10, 20], dtype=np.int32)  # three units of up to 7 columns each
    s_cols = np.array([3, 1, 4, 9, 5, 2, 6], dtype=np.int32)
    d_cols = np.array([2, 7, 1, 8, 0, 5, 9], dtype=np.int32)
    rng = np.random.default_rng(3)
    order = WordOrder(rng.integers(0, 1 << 40, 3).astype(np.int64), run, dims,
                      cols=rng.integers(0, 1 << 30, 7).astype(np.int64))  # fmt: skip
    summed = torch.zeros(1, dtype=torch.int64, device=where.device)
    copy_outer(s_table, d_table, offsets, s_cols, d_cols, impl=where.impl, checksum=summed, order=order)
    s_idx = (offsets[:, None] + s_cols[None, :]).reshape(-1)
    d_idx = (offsets[:, None] + d_cols[None, :]).reshape(-1)
    assert checksum_value(summed) == _defined_sum(src, entry_bytes, s_idx, order)
    got, want = out.cpu().view(n, entry_bytes), src.cpu().view(n, entry_bytes)
    for s_i, d_i in zip(s_idx, d_idx, strict=True):
        assert torch.equal(got[d_i], want[s_i])
    again = torch.zeros(1, dtype=torch.int64, device=where.device)  # the same sum from index arrays
    copy_entries(s_table, d_table, s_idx, d_idx, impl=where.impl, checksum=again, order=order)
    assert checksum_value(again) == checksum_value(summed)


@pytest.mark.parametrize(
    ("order", "match"),
    [
        (WordOrder(np.zeros(4, np.int64), 4), "order given as factors"),
        (WordOrder(np.zeros(2, np.int64), 4, cols=np.zeros(3, np.int64)), "order.first has 2x3 entries"),
        (WordOrder(np.zeros(1, np.int64), 4, cols=np.zeros(2, np.int64)), "order.first has 1x2 entries"),
        (WordOrder(np.zeros(2, np.int64), 4, cols=np.array([0, -5])), "order.cols holds -5"),
    ],
)
def test_bad_factored_sums_raise_before_launch(order: WordOrder, match: str) -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    table = entry_table(buf.data_ptr() + np.arange(4, dtype=np.uint64) * 16, 16, "cpu")
    with pytest.raises(KernelInputError, match=match):
        copy_outer(
            table, table, [0, 1], [0, 1], [2, 2], checksum=torch.zeros(1, dtype=torch.int64), order=order
        )
    assert int(buf.count_nonzero()) == 0


def test_empty_summed_copy_is_zero(where: Where) -> None:
    buf = torch.zeros(64, dtype=torch.uint8, device=where.device)
    table = entry_table(buf.data_ptr() + np.arange(4, dtype=np.uint64) * 16, 16, where.device)
    out = torch.full((1,), 7, dtype=torch.int64, device=where.device)
    copy_entries(table, table, np.zeros(0, np.int32), np.zeros(0, np.int32), impl=where.impl,
                 checksum=out, order=WordOrder(np.zeros(0, np.int64), 4))  # fmt: skip
    assert checksum_value(out) == 0 and int(buf.count_nonzero()) == 0


@pytest.mark.parametrize(
    ("order", "checksum", "match"),
    [
        (WordOrder(np.zeros(2, np.int64), 4), None, "checksum and order go together"),
        (None, torch.zeros(1, dtype=torch.int64), "checksum and order go together"),
        (WordOrder(np.zeros(3, np.int64), 4), torch.zeros(1, dtype=torch.int64), "order.first has 3 entries"),
        (WordOrder(np.array([0, -1]), 4), torch.zeros(1, dtype=torch.int64), "holds -1"),
        (WordOrder(np.zeros(2, np.int64), 3), torch.zeros(1, dtype=torch.int64), "covers 3 words"),
        (WordOrder(np.zeros(2, np.int64), 1, ((2, 1),) * 5), torch.zeros(1, dtype=torch.int64), "5 dims"),
        (WordOrder(np.zeros(2, np.int64), 2, ((2, -1),)), torch.zeros(1, dtype=torch.int64), "step=-1"),
        (WordOrder(np.zeros(2, np.int64), 4), torch.zeros(1, dtype=torch.int32), "int64"),
    ],
)
def test_bad_sums_raise_before_launch(
    order: WordOrder | None, checksum: torch.Tensor | None, match: str
) -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    table = entry_table(buf.data_ptr() + np.arange(4, dtype=np.uint64) * 16, 16, "cpu")
    with pytest.raises(KernelInputError, match=match):
        copy_entries(table, table, [0, 1], [2, 3], checksum=checksum, order=order)
    assert int(buf.count_nonzero()) == 0


@pytest.mark.gpu
def test_summed_copy_never_synchronizes_and_lands_before_its_event() -> None:
    """The sum lands in pinned host memory on the copy's stream, before an event recorded after the
    call: with sync debug mode "error" the wrapper makes no synchronising call, and the value read
    once the event completed is the definition's, while the current stream is held by other work."""
    n, entry_bytes = 256, 4096
    src = torch.randint(0, 256, (n * entry_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(n * entry_bytes, dtype=torch.uint8, device="cuda")
    s_table = entry_table(src.data_ptr() + np.arange(n, dtype=np.uint64) * entry_bytes, entry_bytes, "cuda")
    d_table = entry_table(dst.data_ptr() + np.arange(n, dtype=np.uint64) * entry_bytes, entry_bytes, "cuda")
    stream = torch.cuda.Stream()
    perm = np.random.default_rng(0).permutation(n).astype(np.int32)
    order = WordOrder(np.arange(n, dtype=np.int64) * 3 * entry_bytes, 8, ((entry_bytes // 32, 24),))
    out = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    copy_entries(s_table, d_table, perm, perm, stream=stream, checksum=out, order=order)  # compiles, uploads
    stream.synchronize()
    busy = torch.randn(4096, 4096, device="cuda")
    prototype = "Synchronization debug mode is a prototype"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", prototype, UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", prototype, UserWarning)
            for _ in range(8):  # the current stream is held: nothing of the sum may wait for it
                busy = busy @ busy
            out.zero_()
            copy_entries(s_table, d_table, perm[::-1].copy(), perm, stream=stream, checksum=out, order=order)
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
    finally:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", prototype, UserWarning)
            torch.cuda.set_sync_debug_mode("default")
    done.synchronize()
    assert checksum_value(out) == _defined_sum(src, entry_bytes, perm[::-1].copy(), order)
    torch.cuda.synchronize()


@pytest.mark.parametrize(
    ("sizes", "itemsize", "starts", "total"),
    [
        ((1, 1, 1), 4, [0, 4, 8], 12),
        ((16, 3, 3), 4, [0, 16, 20], 24),
        ((7,), 4, [0], 8),
        ((3, 2), 8, [0, 4], 6),
    ],
)
def test_index_views_start_on_16_bytes(
    sizes: tuple[int, ...], itemsize: int, starts: list[int], total: int
) -> None:
    """The uploaded index views each start on 16 bytes whatever the sizes before them: Triton compiles a
    variant per pattern of its pointers' 16-byte alignment, so views that followed the sizes would
    compile new kernels for new room shapes (on the engine's loop)."""
    got, length = view_starts(sizes, itemsize)
    assert (got, length) == (starts, total)
    assert all(at * itemsize % 16 == 0 for at in got)
    assert all(a + s <= b for a, s, b in zip(got, sizes, [*got[1:], length], strict=True))
