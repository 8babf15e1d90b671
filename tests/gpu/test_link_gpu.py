"""The link probe between two processes on CUDA (skipped without CUDA; docs/PERF.md, "The link probe").

Two NIXL agents of one process reach each other over UCX's TCP loopback even for GPU memory
(tests/integration/test_link_handshake.py asserts that); two processes on one host are what a
deployment has, and UCX carries their GPU-to-GPU WRITE over ``cuda_ipc`` (NVLink, or one GPU's
own memory when both are on ``cuda:0``). The probe names ``cuda_ipc`` by inference: it observes
TCP (this process's sockets moved at least half the WRITE's bytes) and otherwise infers the
transport from where the peer is. So this test also checks what the inference rests on: few TCP
bytes, and a rate far above TCP loopback's (0.3-0.4 GB/s on the H200 machine).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from transfer_engine.testing.cluster import free_port
from transfer_engine.transport.probe import PROBE_BYTES

from .twoproc import DecodeProcess, devices
from .vllm_kv import Side, allocate, make_core, requests_for, run_prefill, wait_reported

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SIDE = Side(layout="LBNHC", num_layers=4, num_heads=8, head_size=128, block_size=16, num_blocks=64)

MIN_GBPS = 4.0
"""Ten times TCP loopback's rate: 4 MiB through ``cuda_ipc`` takes tens of microseconds."""


def test_two_processes_on_cuda_probe_cuda_ipc() -> None:
    """A decode in another process (``refuse_tcp_link``: its handshake waits for the probe and
    fails over TCP) takes one request from a prefill here: no load error, and its one probe says
    ``cuda_ipc``, moved under half its bytes through TCP sockets, at ``MIN_GBPS`` or more."""
    p_dev, d_dev = devices()
    torch.cuda.set_device(torch.device(p_dev))
    port = free_port()
    decoder = DecodeProcess(SIDE, d_dev, port, refuse_tcp_link=True)
    try:
        caches = allocate(SIDE, p_dev)
        prefill = make_core("prefill", SIDE, 0, caches, port, heartbeat_interval=5.0)
        try:
            prefill.start()
            requests = [replace(r, layerwise=False) for r in requests_for(SIDE, SIDE, [256])]
            decoder.ask(requests, prefill.bootstrap)
            run_prefill(prefill, caches, SIDE, 0, requests)
            wait_reported(prefill, {r.transfer_id for r in requests}, prefill=True, timeout=60)
            errors, wrong, _ = decoder.result()
            assert errors == [] and wrong == 0, (
                f"load errors {errors}, decode ranks with wrong bytes: {wrong}"
            )
            ((probe,),) = decoder.links()
            agent = prefill._running().call(lambda engine: engine.agent_name)
            assert probe.peer == agent and probe.nbytes == PROBE_BYTES, probe
            assert probe.transport == "cuda_ipc", probe
            assert probe.tcp_bytes < probe.nbytes // 2, probe
            assert probe.gbps >= MIN_GBPS, probe
            print(f"the decode's link probe: {probe}")  # the figure docs/PERF.md quotes (pytest -s)
        finally:
            prefill.close()
    finally:
        assert decoder.stop() == [{}]
