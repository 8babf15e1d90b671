"""The vLLM connector core over CUDA KV caches laid out as vLLM 0.32 allocates them (run with a GPU:
``tools/gpu_vllm.sh``; skipped without CUDA).

vLLM's CUDA build cannot be installed on the GPU machine, so this proves the core below vLLM, with
the calls vLLM's model runner makes (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``):
``register_kv_caches`` (the core over the caches), ``bind_connector_metadata`` (``begin_layers``),
per layer the attention's cache update queued on the current stream and then ``save_kv_layer``
(``layer_written``), ``wait_for_save`` (``step_written``). The caches (``tests/gpu/vllm_kv.py``) have
the shapes, strides and dtypes of ``vllm/v1/worker/utils.py``'s ``allocate_kv_cache`` under each
``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``); tests/vllm/test_layouts.py checks them against
vLLM's own allocation. The forward's writes run on a stream that is not the default one, as
vLLM's may: the core must take readiness from the CURRENT stream.

With integrity on (docs/INTEGRITY.md), every layout of ``layouts.LAYOUTS`` on both sides at 1K, 4K
and 16K tokens (the lengths whose sums raced the bytes on an H200), the cases above, and a bit
flipped in flight: no good transfer may fail INTEGRITY, and a flipped one must.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

import pytest
import torch

from transfer_engine.integrations.vllm.core import ConnectorCore
from transfer_engine.integrations.vllm.layouts import LAYOUTS
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.room_ids import room_id
from transfer_engine.testing.cluster import free_port
from transfer_engine.transport.faults import Fault, FaultyTransport, Rule, matching
from transfer_engine.transport.nixl import NixlTransport

from .inprocess import cores
from .twoproc import DecodeProcess, devices
from .vllm_kv import (
    Request,
    Side,
    allocate,
    check_decode,
    layer_writes,
    make_core,
    mismatches,
    requests_for,
    run_prefill,
    wait_reported,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FLASH = Side(layout="LBNHC", num_layers=8, num_heads=8, head_size=128, block_size=16, num_blocks=64)
"""FlashAttention's layout (the default preference, NHD), Qwen-like heads, bf16."""

CASES = {
    "flash-P1-D1": (FLASH, FLASH),
    "flash-hnd-P2-to-flash-D1": (replace(FLASH, layout="LBHNC", tp=2), FLASH),
    "flash-P1-to-flashinfer-blackwell-D2": (FLASH, replace(FLASH, layout="BLHNC", tp=2)),
    "flash-P2-to-blocks8-D1": (replace(FLASH, tp=2), replace(FLASH, block_size=8, num_blocks=128)),
    "kernel-blocks-P1-D1": (replace(FLASH, kernel_block_size=8), replace(FLASH, layout="LBHNC")),
    "mla-P2-D1": (replace(FLASH, mla=True, head_size=576, tp=2), replace(FLASH, mla=True, head_size=576)),
    "mla-P1-D2": (replace(FLASH, mla=True, head_size=576), replace(FLASH, mla=True, head_size=576, tp=2)),
    "fp8-P1-D1": (replace(FLASH, dtype=torch.uint8), replace(FLASH, dtype=torch.uint8)),
    "fp8-inc-P2-D2": (
        replace(FLASH, dtype=torch.float8_e4m3fn, tp=2),
        replace(FLASH, dtype=torch.float8_e4m3fn, tp=2),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes(case: str) -> None:
    """Prefill ranks in this process (``cuda:0``), decode ranks in another (``cuda:1`` when two GPUs
    are visible, else ``cuda:0``): three requests, two layer-wise, one sent whole; every byte."""
    prefill, decode = CASES[case]
    p_dev, d_dev = devices()
    torch.cuda.set_device(torch.device(p_dev))
    port = free_port()
    decoder = DecodeProcess(decode, d_dev, port)
    try:
        caches = [allocate(prefill, p_dev) for _ in range(prefill.tp)]
        p_cores = [
            make_core("prefill", prefill, r, caches[r], port, heartbeat_interval=5.0)
            for r in range(prefill.tp)
        ]
        try:
            for core in p_cores:
                core.start()
            requests = requests_for(prefill, decode, [700, 129, 16])
            decoder.ask(requests, p_cores[0].bootstrap)
            forward = torch.cuda.Stream()
            with torch.cuda.stream(forward):
                for rank, core in enumerate(p_cores):
                    run_prefill(core, caches[rank], prefill, rank, requests)
            for core in p_cores:
                wait_reported(core, {r.transfer_id for r in requests}, prefill=True, timeout=60)
            errors, wrong, _ = decoder.result()
            assert errors == [] and wrong == 0, (
                f"load errors {errors}, decode ranks with wrong bytes: {wrong}"
            )
            for core in p_cores:
                assert not {k: v for k, v in core.leaks().items() if v}
        finally:
            for core in p_cores:
                core.close()
    finally:
        assert decoder.stop() == [{}] * decode.tp


class Unwaited(ConnectorCore):
    """The core with the wait removed: its ready events are recorded on an idle stream, so they
    complete at once, whatever the forward's stream still has queued. ``skipped`` counts the events
    it replaced: the control proves nothing unless the core took its events from here."""

    skipped = 0

    def _ready_event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        Unwaited.skipped += 1
        idle = torch.cuda.Stream(self.pool.device)
        return super()._ready_event(idle)


SLEEP_CYCLES = 400_000_000
"""A layer's long kernel: ~0.2-0.3 s at an H100's clock, far longer than a layer group's WRITE."""


def _long_kernel_case(core_cls: type[ConnectorCore]) -> int:
    """One request, layer-wise; before each layer's cache update a long kernel on the forward's
    stream, and ``save_kv_layer`` called at once (the host never waits for the GPU). Returns the
    decode's wrong bytes."""
    side = replace(FLASH, num_layers=4)
    p_dev, d_dev = devices()
    torch.cuda.set_device(torch.device(p_dev))
    with cores(side, side, p_dev, d_dev) as (p_cores, d_cores, p_caches, d_caches):
        p_cores[0].__class__ = core_cls
        requests = requests_for(side, side, [512])
        d_cores[0].receive(
            requests[0].transfer_id, requests[0].transfer_id, requests[0].decode_blocks, p_cores[0].bootstrap
        )
        forward = torch.cuda.Stream()
        with torch.cuda.stream(forward):
            run_prefill(
                p_cores[0],
                p_caches[0],
                side,
                0,
                requests,
                write=lambda layer: torch.cuda._sleep(SLEEP_CYCLES),
            )
        assert not forward.query(), (
            "the forward's kernels ended before the step was reported: the test proves nothing"
        )
        ids = {requests[0].transfer_id}
        wait_reported(p_cores[0], ids, prefill=True, timeout=60)
        assert wait_reported(d_cores[0], ids, prefill=False, timeout=60) == set()
        torch.cuda.synchronize()
        r = requests[0]
        return mismatches(d_caches[0], side, 0, r.number, r.decode_blocks, r.tokens)


def test_long_kernel_layer_is_waited_for() -> None:
    """Each layer's WRITE starts only once the kernels queued before its ``save_kv_layer`` ended."""
    assert _long_kernel_case(ConnectorCore) == 0


def test_long_kernel_without_the_wait_reads_stale_bytes() -> None:
    """The same with the wait removed (:class:`Unwaited`): the WRITEs read the layers before the
    forward wrote them, and the check above sees it. This shows the check can fail."""
    Unwaited.skipped = 0
    stale = _long_kernel_case(Unwaited)
    assert Unwaited.skipped == 2, f"the core took {Unwaited.skipped} of its 2 groups' events from Unwaited"
    assert stale > 0


def test_whole_request_send_waits_for_the_current_stream() -> None:
    """``send`` (vLLM's ``request_finished`` path) records its event on the current stream too."""
    side = replace(FLASH, num_layers=4)
    p_dev, d_dev = devices()
    torch.cuda.set_device(torch.device(p_dev))
    with cores(side, side, p_dev, d_dev) as (p_cores, d_cores, p_caches, d_caches):
        r = replace(requests_for(side, side, [300])[0], layerwise=False)
        d_cores[0].receive(r.transfer_id, r.transfer_id, r.decode_blocks, p_cores[0].bootstrap)
        writes = layer_writes(p_caches[0], side, 0, r.number, r.prefill_blocks, r.tokens)
        forward = torch.cuda.Stream()
        with torch.cuda.stream(forward):
            torch.cuda._sleep(SLEEP_CYCLES)
            for write in writes:
                write()
            p_cores[0].send(r.transfer_id, r.transfer_id, r.prefill_blocks)
        assert not forward.query(), "the kernels ended before send() returned: the test proves nothing"
        wait_reported(p_cores[0], {r.transfer_id}, prefill=True, timeout=60)
        assert wait_reported(d_cores[0], {r.transfer_id}, prefill=False, timeout=60) == set()
        torch.cuda.synchronize()
        check_decode(d_caches[0], side, 0, [r])


# ---- integrity on (docs/INTEGRITY.md) ---------------------------------------------------------------

INTEGRITY_TOKENS = [1024, 4096, 16384]
"""One request of each (1K and 16K layer-wise, 4K sent whole): an H200 failed every block of the
16K-token request, and once the 1K one, while a sum could read the pages before the bytes landed."""

INTEGRITY_SIDE = replace(FLASH, num_blocks=sum(-(-n // FLASH.block_size) for n in INTEGRITY_TOKENS))
"""FLASH with room for the three requests at once (1344 blocks, 704 MB a side)."""

LAYOUT_PAIRS = [(name, list(LAYOUTS)[(i + 1) % len(LAYOUTS)]) for i, name in enumerate(LAYOUTS)]
"""Every vLLM layout on the prefill, each against the next one on the decode: every layout is on
both sides once, and each pair's sums must agree across two different layouts."""


@pytest.fixture(scope="module")
def integrity_decoder() -> Iterator[DecodeProcess]:
    """One decode process for the module's integrity cases (``DecodeProcess.reset`` between them)."""
    _, d_dev = devices()
    decoder = DecodeProcess(INTEGRITY_SIDE, d_dev, free_port(), integrity=True)
    stopped = False
    try:
        yield decoder
        leaks = decoder.stop()
        stopped = True
        assert leaks == [{}] * decoder.side.tp, f"decode leaked: {leaks}"
    finally:
        if not stopped:
            decoder.stop()


def staged_bound(prefill: Side, decode: Side, tokens: Sequence[int]) -> int:
    """Bytes of the largest request of ``tokens`` with every layer, on the side with more local
    heads: no staged chunk of it can be larger. The vLLM core makes a request one chunk (a WRITE of
    ``layers_per_write`` layers, or every layer when sent whole), and a staged chunk larger than the
    prefill's staging buffer or the decode's ring fails its room (STAGING, docs/DECISIONS.md); their
    defaults (2 and 4 chunks of ``staging_chunk_pages`` blocks) are smaller than a 4K-token request
    sent whole, so the cases over unequal layouts (staged) size both to this."""

    def per_token(side: Side) -> int:
        item = torch.empty(0, dtype=side.dtype).element_size()
        return side.num_layers * side.heads_local * side.content * item

    padded = max(-(-n // min(prefill.block_size, decode.block_size)) for n in tokens) * max(
        prefill.block_size, decode.block_size
    )
    return padded * max(per_token(prefill), per_token(decode))


def integrity_case(
    decoder: DecodeProcess,
    prefill: Side,
    decode: Side,
    tokens: Sequence[int],
    device: str,
    staged_bytes: int = 0,
) -> dict[str, int]:
    """Integrity on both sides: the decode process restarted on ``decode`` asks for one request of
    each of ``tokens``, the prefill ranks here (on ``device``) run one forward that writes them on a
    non-default stream. Every request is reported with no load error, every byte lands and nothing
    else is written, nothing leaks on the prefill. ``staged_bytes``: the prefill's ``staging_bytes``
    and the decode's ``ring_bytes`` (0: their defaults). Returns the decode ranks' counters, summed."""
    decoder.reset(decode, integrity=True, ring_bytes=staged_bytes)
    port = free_port()
    caches = [allocate(prefill, device) for _ in range(prefill.tp)]
    p_cores = [
        make_core(
            "prefill",
            prefill,
            r,
            caches[r],
            port,
            heartbeat_interval=5.0,
            integrity=True,
            staging_bytes=staged_bytes,
        )
        for r in range(prefill.tp)
    ]
    try:
        for core in p_cores:
            core.start()
        requests = requests_for(prefill, decode, tokens)
        decoder.ask(requests, p_cores[0].bootstrap)
        forward = torch.cuda.Stream() if device.startswith("cuda") else None
        with torch.cuda.stream(forward) if forward is not None else contextlib.nullcontext():
            for rank, core in enumerate(p_cores):
                run_prefill(core, caches[rank], prefill, rank, requests)
        for core in p_cores:
            wait_reported(core, {r.transfer_id for r in requests}, prefill=True, timeout=120)
        errors, wrong, _ = decoder.result(timeout=120)
        counters = decoder.counters()
        assert errors == [] and wrong == 0, (
            f"load errors {errors} (INTEGRITY failures: {[c.get('failed_integrity', 0) for c in counters]}), "
            f"decode ranks with wrong bytes: {wrong}"
        )
        for core in p_cores:
            assert not {k: v for k, v in core.leaks().items() if v}
    finally:
        for core in p_cores:
            core.close()
    total: dict[str, int] = {}
    for rank_counters in counters:
        for key, value in rank_counters.items():
            total[key] = total.get(key, 0) + value
    return total


def assert_every_chunk_matched(counters: dict[str, int], requests: int) -> None:
    """No INTEGRITY failure, no mismatch, nothing unchecked, and at least one match a request."""
    judged = {k: counters.get(k, 0) for k in ("integrity_match", "integrity_mismatch", "integrity_unchecked")}
    assert counters.get("failed_integrity", 0) == 0, judged
    assert judged["integrity_mismatch"] == 0 and judged["integrity_unchecked"] == 0, judged
    assert judged["integrity_match"] >= requests, judged


@pytest.mark.parametrize(
    ("prefill_layout", "decode_layout"), LAYOUT_PAIRS, ids=[f"{a}-to-{b}" for a, b in LAYOUT_PAIRS]
)
def test_integrity_every_layout_1k_4k_16k(
    integrity_decoder: DecodeProcess, prefill_layout: str, decode_layout: str
) -> None:
    """Integrity on, prefill in this process and decode in another, 1K/4K/16K tokens: zero INTEGRITY
    failures, every chunk's sum matched the writer's, every byte right."""
    p_dev, _ = devices()
    torch.cuda.set_device(torch.device(p_dev))
    prefill = replace(INTEGRITY_SIDE, layout=prefill_layout)
    decode = replace(INTEGRITY_SIDE, layout=decode_layout)
    bound = staged_bound(prefill, decode, INTEGRITY_TOKENS)
    counters = integrity_case(integrity_decoder, prefill, decode, INTEGRITY_TOKENS, p_dev, bound)
    assert_every_chunk_matched(counters, len(INTEGRITY_TOKENS))


@pytest.mark.parametrize("case", list(CASES))
def test_integrity_cases(integrity_decoder: DecodeProcess, case: str) -> None:
    """The two-process cases above (TP splits, MLA, fp8, kernel blocks, other block sizes) with
    integrity on: zero INTEGRITY failures, every byte right."""
    prefill, decode = CASES[case]
    p_dev, _ = devices()
    torch.cuda.set_device(torch.device(p_dev))
    counters = integrity_case(integrity_decoder, prefill, decode, [700, 129, 16], p_dev)
    assert_every_chunk_matched(counters, 3)


def assert_no_leaks(*sides: ConnectorCore) -> None:
    """Nothing left on any core (30 s at most for rooms ending): no room, stash, WRITE or request."""
    deadline = time.monotonic() + 30
    for side in sides:
        while leaks := {k: v for k, v in side.leaks().items() if v}:
            assert time.monotonic() < deadline, f"{side.config.role} leaked: {leaks}"
            time.sleep(0.05)


def flipped_case(flipped: int, p_dev: str, d_dev: str) -> None:
    """Two requests of 1K tokens (the first layer-wise, the second sent whole), integrity on, prefill
    and decode cores in this process; the prefill's real NIXL transport wrapped in the fault
    transport, which flips one bit of the first WRITE of request ``flipped`` in flight. The decode
    reports that request's blocks as load errors after one INTEGRITY failure, the other request lands
    byte-exact, nothing leaks. The kernel path is off (``kernel_path=False``): two cores of one process
    on one GPU would otherwise take it (integrity rides on it) and no WRITE would go through NIXL to
    flip; a flip on the kernel path is ``tests/gpu/test_kernel_path_gpu.py``'s."""
    side = replace(FLASH, num_layers=4, num_blocks=128)
    requests = requests_for(side, side, [1024, 1024])
    bad: Request = requests[flipped]
    rule = Rule(Fault.FLIP, match=matching(m.ChunkLanded, room=room_id(bad.transfer_id)))
    name = f"vllm-gpu-flip-{os.getpid()}-{flipped}"
    wrapper = FaultyTransport(NixlTransport(name), writes=[rule])
    port = free_port()
    p_caches, d_caches = allocate(side, p_dev), allocate(side, d_dev)
    prefill = make_core(
        "prefill",
        side,
        0,
        p_caches,
        port,
        integrity=True,
        agent_name=name,
        transport=wrapper,
        kernel_path=False,
    )
    decode = make_core("decode", side, 0, d_caches, port, integrity=True, kernel_path=False)
    started: list[ConnectorCore] = []
    try:
        for core in (prefill, decode):
            core.start()
            started.append(core)
        for r in requests:
            decode.receive(r.transfer_id, r.transfer_id, r.decode_blocks, prefill.bootstrap)
        forward = torch.cuda.Stream() if p_dev.startswith("cuda") else None
        with torch.cuda.stream(forward) if forward is not None else contextlib.nullcontext():
            run_prefill(prefill, p_caches, side, 0, requests)
        ids = {r.transfer_id for r in requests}
        wait_reported(prefill, ids, prefill=True, timeout=60)
        errors = wait_reported(decode, ids, prefill=False, timeout=60)
        assert errors == {str(b) for b in bad.decode_blocks}, errors
        assert rule.fired == 1 and wrapper.fired["flip"] == 1
        counters = decode._running().call(lambda e: dict(e.counters))
        assert counters.get("failed_integrity", 0) == 1, counters
        assert counters.get("integrity_mismatch", 0) >= 1, counters
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        good = requests[1 - flipped]
        assert mismatches(d_caches, side, 0, good.number, good.decode_blocks, good.tokens) == 0
        assert_no_leaks(prefill, decode)
    finally:
        for core in reversed(started):
            core.close()


@pytest.mark.parametrize("flipped", [0, 1], ids=["layerwise", "whole"])
def test_integrity_a_flipped_bit_fails_its_request_only(flipped: int) -> None:
    """A bit flipped in flight in one of two requests (a layer group's WRITE, or the WRITE of the
    request sent whole), on CUDA caches: caught, that request fails INTEGRITY, the other is byte-exact."""
    p_dev, d_dev = devices()
    torch.cuda.set_device(torch.device(p_dev))
    flipped_case(flipped, p_dev, d_dev)
