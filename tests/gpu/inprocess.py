"""P prefill and D decode connector cores in this process (real NIXL and ZMQ), one case run end to end."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from transfer_engine.integrations.vllm.core import ConnectorCore
from transfer_engine.testing.cluster import free_port

from .vllm_kv import Request, Side, allocate, check_decode, make_core, run_prefill, wait_reported


@contextlib.contextmanager
def cores(
    prefill: Side,
    decode: Side,
    device: str,
    decode_device: str | None = None,
    prefill_caches: list[dict[str, torch.Tensor]] | None = None,
) -> Iterator[tuple[list[ConnectorCore], list[ConnectorCore], list[dict], list[dict]]]:
    """Started cores over fresh vLLM-shaped caches (or the prefill's given ones): (prefill cores,
    decode cores, their caches)."""
    port = free_port()
    p_caches = prefill_caches or [allocate(prefill, device) for _ in range(prefill.tp)]
    d_caches = [allocate(decode, decode_device or device) for _ in range(decode.tp)]
    started: list[ConnectorCore] = []
    try:
        p_cores = [make_core("prefill", prefill, r, p_caches[r], port) for r in range(prefill.tp)]
        d_cores = [make_core("decode", decode, r, d_caches[r], port) for r in range(decode.tp)]
        for core in (*p_cores, *d_cores):
            core.start()
            started.append(core)
        yield p_cores, d_cores, p_caches, d_caches
    finally:
        for core in reversed(started):
            core.close()


def run_case(
    prefill: Side,
    decode: Side,
    requests: Sequence[Request],
    device: str = "cpu",
    *,
    decode_device: str | None = None,
    write: Callable[[int], None] | None = None,
    prefill_caches: list[dict[str, torch.Tensor]] | None = None,
) -> int:
    """Decode ranks ask for every request, prefill ranks run one forward step as vLLM does; both
    sides report every request, every byte lands where it belongs, nothing leaks. Returns the
    prefill's staged WRITEs (0: every WRITE went direct, from the caches to the decode's)."""
    with cores(prefill, decode, device, decode_device, prefill_caches) as (
        p_cores,
        d_cores,
        p_caches,
        d_caches,
    ):
        ids = {r.transfer_id for r in requests}
        for core in d_cores:
            for r in requests:
                core.receive(r.transfer_id, r.transfer_id, r.decode_blocks, p_cores[0].bootstrap)
        for rank, core in enumerate(p_cores):
            run_prefill(core, p_caches[rank], prefill, rank, requests, write)
        for core in p_cores:
            wait_reported(core, ids, prefill=True)
        for core in d_cores:
            assert wait_reported(core, ids, prefill=False) == set(), "the decode reported load errors"
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for rank, caches in enumerate(d_caches):
            check_decode(caches, decode, rank, requests)
        for core in (*p_cores, *d_cores):
            assert not {k: v for k, v in core.leaks().items() if v}, f"{core.config.role} leaked"
        return sum(
            core._running().call(lambda engine: sum(w.counters["staged_writes"] for w in engine.workers))
            for core in p_cores
        )
