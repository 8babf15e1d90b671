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
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from transfer_engine.integrations.vllm.core import ConnectorCore
from transfer_engine.testing.cluster import free_port

from .inprocess import cores
from .twoproc import DecodeProcess, devices
from .vllm_kv import (
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
    complete at once, whatever the forward's stream still has queued."""

    def _ready_event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
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
    assert _long_kernel_case(Unwaited) > 0


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
