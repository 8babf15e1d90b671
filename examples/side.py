"""What a rank process of ``prefill.py`` and one of ``decode.py`` do alike.

Both end their command line the same way (the workload flags, the engine's ``EngineConfig`` flags,
the same checks: :func:`parse_args`), hold the same kind of synthetic KV pool with rooms open in a
window of ``--inflight`` (:class:`RankPool`), and print the same first and last lines.

Like ``common.py``, this module imports no torch, NIXL or engine code at import time: the launcher
processes stay light.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import common

if TYPE_CHECKING:
    import numpy as np

    from transfer_engine.engine import TransferEngine


def parse_args(
    parser: argparse.ArgumentParser, argv: list[str] | None, role: str, skip: Sequence[str]
) -> argparse.Namespace:
    """Add the workload flags and the engine's (all but ``skip`` and the side's own) to ``parser``,
    parse ``argv`` and check it: ``--tp`` (the side's own flag) >= 1, the workload, and an
    ``EngineConfig`` of ``role`` built from it. A bad value exits through ``parser.error``."""
    from transfer_engine.config import EngineConfig
    from transfer_engine.errors import ConfigError

    common.add_workload_arguments(parser)
    group = parser.add_argument_group("engine (EngineConfig fields; TE_* environment variables apply too)")
    ours = {a.dest for a in parser._actions}
    EngineConfig.add_arguments(group, skip=(*skip, *ours))  # type: ignore[arg-type]
    args = parser.parse_args(argv)
    if args.tp < 1:
        parser.error(f"--tp={args.tp} must be >= 1")
    problem = common.check_workload(args)
    if problem:
        parser.error(problem)
    try:
        EngineConfig.from_args(args, role=role, tp_size=args.tp, tp_rank=0)
    except ConfigError as exc:
        parser.error(str(exc))
    return args


class RankPool:
    """One rank's synthetic KV pool (``--device``, sized by ``common.pool_pages``), and what the
    schedule's open rooms hold of it.

    A room takes (:meth:`take`) a place in the window of ``--inflight`` rooms, its pages from a
    :class:`common.PageAllocator` and, with ``--aux-bytes``, an aux slot; it gives all three back at
    once (:meth:`give_back`) when no WRITE of it can land any more. Made in the rank process, on its
    event loop; only the schedule's one loop takes.
    """

    def __init__(self, role: str, rank: int, args: argparse.Namespace) -> None:
        import anyio
        import torch

        from transfer_engine.memory.layout import KVPool

        self.role, self.rank = role, rank
        self.name = f"{role} rank {rank}/{args.tp}"
        self.layout = layout = common.make_layout(args)
        self.device = common.device_for(args.device, rank)
        itemsize = torch.empty(0, dtype=layout.dtype).element_size()
        self.page_bytes = (
            layout.page_size
            * layout.heads_local(args.tp)
            * layout.head_dim
            * itemsize
            * layout.num_kv_tensors
        )
        self.num_pages = common.pool_pages(args, self.page_bytes)
        self.aux_bytes = args.aux_bytes
        self.use_aux = args.aux_bytes > 0
        self.pool = KVPool.allocate(
            layout,
            args.tp,
            rank,
            self.num_pages,
            device=self.device,
            aux_slots=args.inflight if self.use_aux else 0,
            aux_item_bytes=args.aux_bytes,
        )
        self.alloc = common.PageAllocator(self.num_pages, f"{role}:{args.seed}:{rank}")
        self.aux_slots = list(range(args.inflight))
        self.window = anyio.Semaphore(args.inflight)

    def room_bytes(self, plan: common.RoomPlan) -> int:
        """Bytes of ``plan``'s room on this rank: its pages in every KV tensor, and its aux item."""
        return plan.num_pages * self.page_bytes + (self.aux_bytes if self.use_aux else 0)

    async def take(
        self, plan: common.RoomPlan, trace: common.ExampleTrace | None = None
    ) -> tuple[np.ndarray, int | None]:
        """Wait for a place in the window (``trace`` marks ``window`` once it has it), then for
        ``plan``'s pages; returns them and the room's aux slot (None without aux items)."""
        await self.window.acquire()
        if trace is not None:
            trace.mark(plan.room, "window")
        pages = await self.alloc.alloc(plan.num_pages)
        slot = self.aux_slots.pop() if self.use_aux else None
        return pages, slot

    def give_back(self, pages: np.ndarray, slot: int | None) -> None:
        """What :meth:`take` gave a room; call once no WRITE of the room can land any more."""
        self.alloc.free(pages)
        if slot is not None:
            self.aux_slots.append(slot)
        self.window.release()

    def say_up(self, engine: TransferEngine, events: Any, where: str = "") -> None:
        """The rank's first lines (its endpoints and pool; ``where``: more about its agent) and its
        ``up`` event."""
        common.say(
            f"{self.name}: control endpoint {engine.endpoint} (agent {engine.agent_name}{where}); "
            f"pool {self.num_pages} pages = {common.human_bytes(self.num_pages * self.page_bytes)} "
            f"on {self.device}"
        )
        metrics = f", metrics {engine.metrics_endpoint}" if engine.metrics_endpoint else ""
        common.say(f"{self.name}: introspect {engine.introspect_endpoint}{metrics}")
        events.put(("up", self.rank, engine.endpoint))

    def say_end(self, stats: dict[str, Any], total: int, moved: str) -> None:
        """The rank's last line: its rooms ok, failed and not run of ``total``, its bytes (then
        ``moved``: what became of them, in how long), and the signal that stopped it, if one did."""
        missing = total - stats["ok"] - stats["failed"]
        common.say(
            f"{self.name}: rooms ok={stats['ok']} failed={stats['failed']} not-run={missing} of {total}, "
            f"{common.human_bytes(stats['bytes'])} {moved}"
            + (f" (stopped by {common.STOP.name})" if common.STOP.signum else "")
        )


def run_rank(serve: Any, role: str, rank: int, args: argparse.Namespace, events: Any) -> None:
    """Body of a rank process of ``role``: ``serve(rank, args, events)`` on an event loop, under
    :func:`common.rank_entry`; exits with its status."""
    import anyio

    name = f"{role} rank {rank}/{args.tp}"
    common.rank_entry(lambda: anyio.run(serve, rank, args, events), name, args, events)
