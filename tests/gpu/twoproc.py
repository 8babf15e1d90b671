"""The decode side in a process of its own (spawned), the prefill in the caller's: two processes, one
GPU each when two are visible (both on ``cuda:0`` otherwise). Used by tests/gpu and tools/bench_vllm_core.py.

The parent sends the decode process one command at a time on a pipe and waits for its answer:

- ``("receive", requests, bootstrap, check)``: open every request's room (``receive``) and answer ``"asked"``; then,
  once every one was reported: ``("done", load_errors, wrong_bytes, loaded_ns)`` where
  ``wrong_bytes`` counts the decode ranks whose bytes were wrong (-1 when ``check`` is False) and ``loaded_ns`` the
  ``time.monotonic_ns()`` (one clock for every process of the host) at which the last was reported;
- ``("counters",)``: answers ``("counters", [each decode rank's engine counters])`` (``integrity_match``,
  ``integrity_mismatch``, ``failed_integrity``...: totals since its cores started);
- ``("links",)``: answers ``("links", [each decode rank's link probes])`` (``TransferEngine.links``:
  what its first handshake with each prefill rank measured, ``transport.probe.LinkProbe``);
- ``("side", side, config)``: close the cores, then make new ones over fresh caches of ``side`` with
  ``config`` (answers ``"up"``): one process serves several layouts, without a new spawn each;
- ``("stop",)``: close the cores and exit (answers ``"stopped"`` with the leak counters).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from transfer_engine.integrations.vllm.core import ConnectorCore
from transfer_engine.transport.probe import LinkProbe

from .vllm_kv import Request, Side, allocate, check_decode, make_core

START_S = 120.0


def devices() -> tuple[str, str]:
    """(prefill device, decode device): two GPUs when two are visible, else both on the one."""
    return ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cuda:0", "cuda:0")


def _start(
    side: Side, device: str, port: int, config: dict[str, Any]
) -> tuple[list[dict[str, torch.Tensor]], list[ConnectorCore]]:
    """Fresh caches of ``side`` and started decode cores over them (closed again if one fails)."""
    caches = [allocate(side, device) for _ in range(side.tp)]
    cores = [make_core("decode", side, r, caches[r], port, **config) for r in range(side.tp)]
    started: list[ConnectorCore] = []
    try:
        for core in cores:
            core.start()
            started.append(core)
    except BaseException:
        for core in started:
            core.close()
        raise
    return caches, cores


def _decode_main(conn: Connection, side: Side, device: str, port: int, config: dict[str, Any]) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    cores: list[ConnectorCore] = []
    try:
        caches, cores = _start(side, device, port, config)
        conn.send("up")
        while True:
            command = conn.recv()
            if command[0] == "stop":
                leaks = [{k: v for k, v in core.leaks().items() if v} for core in cores]
                conn.send(("stopped", leaks))
                return
            if command[0] == "counters":
                conn.send(("counters", [core._running().call(lambda e: dict(e.counters)) for core in cores]))
                continue
            if command[0] == "links":
                conn.send(
                    ("links", [core._running().call(lambda e: list(e.links.values())) for core in cores])
                )
                continue
            if command[0] == "side":
                _, side, config = command
                for core in cores:
                    core.close()
                cores = []
                caches = []  # the old caches are freed before the new ones are allocated
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
                caches, cores = _start(side, device, port, config)
                conn.send("up")
                continue
            _, requests, bootstrap, check_bytes = command
            for core in cores:
                for r in requests:
                    core.receive(r.transfer_id, r.transfer_id, r.decode_blocks, bootstrap)
            conn.send("asked")
            ids = {r.transfer_id for r in requests}
            pending = [set(ids) for _ in cores]
            errors: set[int] = set()
            deadline = time.monotonic() + 60
            while any(pending) and time.monotonic() < deadline:
                for core, left in zip(cores, pending, strict=True):
                    if left:
                        core.wait_for_news(0.5)
                        left -= core.take_finished()[1]
                        errors |= core.take_load_errors()
            loaded_ns = time.monotonic_ns()
            if any(pending):
                conn.send(("timeout", sorted(set().union(*pending))))
                continue
            wrong = -1
            if check_bytes:
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                wrong = 0
                for rank, rank_caches in enumerate(caches):
                    try:
                        check_decode(rank_caches, side, rank, requests)
                    except AssertionError as exc:
                        wrong += 1
                        print(f"decode rank {rank}: {exc}", flush=True)
                    for cache in rank_caches.values():  # the next command starts from zeros
                        cache.view(torch.uint8).zero_()
            conn.send(("done", sorted(errors), wrong, loaded_ns))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    finally:
        for core in cores:
            core.close()


class DecodeProcess:
    """The decode side's cores in a spawned process (see the module docstring)."""

    def __init__(self, side: Side, device: str, port: int, **config: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.side = side
        self._proc = ctx.Process(
            target=_decode_main,
            args=(child, side, device, port, {"heartbeat_interval": 5.0, **config}),
            daemon=True,
        )
        self._proc.start()
        self._expect("up", START_S)

    def _expect(self, what: str, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"the decode process did not answer {what!r} within {timeout} s")
        answer = self._conn.recv()
        if isinstance(answer, tuple) and answer[0] == "error":
            raise RuntimeError(f"the decode process failed:\n{answer[1]}")
        if answer != what and not (isinstance(answer, tuple) and answer[0] == what):
            raise RuntimeError(f"the decode process answered {answer!r}, expected {what!r}")
        return answer

    def ask(self, requests: Sequence[Request], bootstrap: str, *, check: bool = True) -> None:
        """Open the requests' rooms on every decode rank; returns once they were handed to the cores.
        ``check``: check every byte once they landed (then zero the caches)."""
        self._conn.send(("receive", list(requests), bootstrap, check))
        self._expect("asked", 30)

    def result(self, timeout: float = 90) -> tuple[list[int], int, int]:
        """(load errors, decode ranks with wrong bytes or -1, monotonic ns of the last report)."""
        _, errors, wrong, loaded_ns = self._expect("done", timeout)
        return errors, wrong, loaded_ns

    def counters(self) -> list[dict[str, int]]:
        """Each decode rank's engine counters, totals since its cores started."""
        self._conn.send(("counters",))
        _, counters = self._expect("counters", 30)
        return list(counters)

    def links(self) -> list[list[LinkProbe]]:
        """Each decode rank's link probes (one per prefill rank it has met)."""
        self._conn.send(("links",))
        _, links = self._expect("links", 30)
        return list(links)

    def reset(self, side: Side, **config: Any) -> None:
        """Close the decode cores and start new ones over fresh caches of ``side``, with ``config``
        (EngineConfig fields, as given to the constructor); their counters start at zero."""
        self._conn.send(("side", side, {"heartbeat_interval": 5.0, **config}))
        self._expect("up", START_S)
        self.side = side

    def stop(self) -> list[dict[str, int]]:
        """Close the cores; returns each decode rank's non-zero leak counters."""
        try:
            self._conn.send(("stop",))
            _, leaks = self._expect("stopped", 60)
            return leaks
        finally:
            self._proc.join(60)
            if self._proc.is_alive():
                self._proc.kill()
