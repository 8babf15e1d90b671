"""The TP group of one server: torch.distributed for the model, and the leader's step plans.

Two process groups: the model's (NCCL on CUDA, gloo on CPU) carries the all-reduces of the forward;
a gloo group on the CPU carries the control traffic of the serving loop: the leader (rank 0)
broadcasts each step's plan (msgpack bytes) and every rank contributes to one MIN-reduction of
per-request values (room status, settled, completion time) at the end of the step.

Control collectives are issued asynchronously and polled from the event loop, so a rank that waits
for the leader's next plan keeps serving its engine (heartbeats, notifications); the model's
all-reduces are blocking, since every rank runs them within the same step.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import torch
import torch.distributed as dist

from transfer_engine import ConfigError
from transfer_engine.runtime.ticker import sleep as fine_sleep


class TPGroup:
    """Rank ``rank`` of a ``size``-way group rendezvousing at ``tcp://127.0.0.1:port``."""

    def __init__(self, size: int, rank: int, port: int, device: torch.device) -> None:
        self.size, self.rank, self.device = size, rank, device
        self._control: Any = None
        if size > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                world_size=size,
                rank=rank,
                timeout=timedelta(seconds=120),
            )
            self._control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the group in place (the model's all-reduce); blocking, on the tensor's device."""
        if self.size > 1:
            dist.all_reduce(t)

    async def _wait(self, work: Any) -> None:
        """Poll an async collective from the loop: a few bare yields, then timerfd sleeps growing from
        50 us to 2 ms (asyncio's own timers would round every wait up to a whole millisecond)."""
        spins = 0
        delay = 50e-6
        while not work.is_completed():
            spins += 1
            if spins <= 10:
                await anyio.lowlevel.checkpoint()
            else:
                await fine_sleep(delay)
                delay = min(2 * delay, 0.002)
        work.wait()

    async def broadcast(self, payload: bytes | None) -> bytes:
        """The leader's ``payload`` on every rank (followers pass None); polls, never blocks the loop."""
        if self.size == 1:
            assert payload is not None
            return payload
        n = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        await self._wait(dist.broadcast(n, 0, group=self._control, async_op=True))
        if self.leader:
            assert payload is not None
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(int(n.item()), dtype=torch.uint8)
        if buf.numel():
            await self._wait(dist.broadcast(buf, 0, group=self._control, async_op=True))
        return bytes(buf.numpy().tobytes())

    async def reduce_min(self, values: list[float]) -> list[float]:
        """Element-wise minimum of every rank's ``values`` (same length on every rank), on every rank."""
        if self.size == 1 or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        await self._wait(dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._control, async_op=True))
        return [float(v) for v in t.tolist()]

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def encode(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def check_tp(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
