"""The scheduler side of the vLLM connector, plain Python: :class:`TransferBook` decides, from vLLM's
scheduler calls, which transfers the workers start, abort or cancel each step
(:class:`TransferMetadata`), and when a request's blocks may be freed."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.request import RequestStatus

from .params import Plan, plan_of

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = ["FINISHED_OK", "RequestView", "Transfer", "TransferBook", "TransferMetadata"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transfer:
    """One request's transfer as the scheduler hands it to the workers."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    """Prefill: the blocks of the whole prompt. Decode: those of tokens ``prefix_len`` onwards."""
    bootstrap: str = ""
    """Decode only: the prefill instance's bootstrap endpoint."""
    prefix_len: int = 0
    """Decode only: the prompt tokens already in the decode's prefix cache (whole blocks)."""


@dataclass
class TransferMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: transfers to start, requests to abort, and (decode)
    requests that ended before their room opened, whose prefill must hear it (``cancel``)."""

    start: list[Transfer] = field(default_factory=list)
    announce: list[Transfer] = field(default_factory=list)
    """Decode: requests just queued here that will ask a prefill for their KV; each rank announces
    the room to that prefill (``TransferEngine.announce``), whose lease on it the announcement renews
    while the request waits in vLLM's queue (no blocks, no room here yet)."""
    layerwise: list[Transfer] = field(default_factory=list)
    """Prefill: requests whose last prompt tokens this step computes; their layers go out as the
    forward writes them (``save_kv_layer``)."""
    abort: list[Transfer] = field(default_factory=list)
    cancel: list[Transfer] = field(default_factory=list)
    idle: bool = False
    """The step runs no model: the workers may wait (``IDLE_WAIT_S``) for a transfer to end."""


class RequestView(Protocol):
    """What :class:`TransferBook` reads of a vLLM ``Request``."""

    @property
    def request_id(self) -> str: ...
    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...
    @property
    def prompt_token_ids(self) -> list[int] | None: ...
    @property
    def status(self) -> RequestStatus: ...


FINISHED_OK = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class TransferBook:
    """The scheduler side's state and decisions, plain Python (no vLLM process needed to test it).

    Never raises on what a request carries: bad ``kv_transfer_params`` are logged (once per
    request) and the request is left to vLLM as if it carried none."""

    def __init__(self, *, is_prefill: bool, block_size: int, bootstrap: str = "", tp_size: int = 1) -> None:
        self.is_prefill = is_prefill
        self.block_size = block_size
        self.bootstrap = bootstrap
        """Prefill: this instance's bootstrap endpoint, for the decode (``finished``'s params)."""
        self.tp_size = tp_size
        self.pending = TransferMetadata()
        self.in_flight: dict[str, Transfer] = {}
        """Requests whose transfer the workers have not reported ended yet."""
        self.asked: set[str] = set()
        """Decode: requests whose blocks were already given to a transfer, or whose room was
        cancelled because the decode had it all cached (never ask twice)."""
        self.prefilling: dict[str, _Prefilling] = {}
        """Prefill: requests to send whose last prompt tokens are not scheduled yet."""
        self.layerwise: set[str] = set()
        """Prefill: requests whose layer-wise send started and that have not finished."""
        self.sent_early: set[str] = set()
        """Prefill: requests of ``layerwise`` whose room ended before they finished."""
        self.warned: set[str] = set()
        """Requests whose params' problems were logged already."""

    def _num_blocks(self, request: RequestView) -> int:
        return -(-len(request.prompt_token_ids or ()) // self.block_size)

    def _plan(self, request: RequestView) -> Plan | None:
        """The request's plan; its problems are logged the first time (vLLM asks again each step
        a request waits), and a transfer ID another live request holds here refuses the plan."""
        req_id = request.request_id
        plan, problems = plan_of(
            req_id, request.kv_transfer_params, is_prefill=self.is_prefill, block_size=self.block_size
        )
        if plan is not None:
            holder = self._holder(plan.transfer_id)
            if holder is not None and holder != req_id:
                problems.append(f"key 'transfer_id'={plan.transfer_id!r} is live for request {holder}")
                plan = None
        if problems and req_id not in self.warned:
            self.warned.add(req_id)
            if plan is not None:
                outcome = "the transfer goes ahead"
            else:
                outcome = "its KV is not sent" if self.is_prefill else "its prompt is computed here"
            for problem in problems:
                log.warning("request %s: kv_transfer_params %s; %s", req_id, problem, outcome)
        return plan

    def _holder(self, transfer_id: str) -> str | None:
        for req_id, transfer in self.in_flight.items():
            if transfer.transfer_id == transfer_id:
                return req_id
        for req_id, prefilling in self.prefilling.items():
            if prefilling.transfer_id == transfer_id:
                return req_id
        return None

    def added(self, request: RequestView) -> None:
        """vLLM's ``on_new_request``. Decode: a request that will ask a prefill for its KV is
        announced to that prefill now, before it waits in vLLM's queue: the prefill may have finished
        already and holds the KV for it (the sequential protocol), its lease renewed while the
        announcement lasts. It lasts until the request's room opens or is cancelled (:meth:`allocated`,
        :meth:`matched` or :meth:`finished` start or cancel every planned request)."""
        if self.is_prefill:
            return
        plan = self._plan(request)
        if plan is not None:
            self.pending.announce.append(Transfer(request.request_id, plan.transfer_id, (), plan.bootstrap))

    def matched(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        """Decode: the prompt past the locally cached ``num_computed_tokens`` comes from the
        prefill, loaded asynchronously; all of it cached: nothing, and the prefill's room is
        cancelled now. Prefill: nothing."""
        req_id = request.request_id
        if self.is_prefill or req_id in self.asked:
            return 0, False
        plan = self._plan(request)
        if plan is None:
            return 0, False
        if num_computed_tokens % self.block_size:  # vLLM's prefix hits are whole blocks
            log.warning(
                "request %s: %d cached tokens is not a whole number of blocks; its prompt is computed here",
                req_id, num_computed_tokens,
            )  # fmt: skip
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count > 0:
            return count, True
        self.asked.add(req_id)
        self.pending.cancel.append(Transfer(req_id, plan.transfer_id, (), plan.bootstrap))
        return 0, False

    def allocated(self, request: RequestView, block_ids: list[int], num_external_tokens: int) -> None:
        """Decode: the blocks for the prompt exist (``block_ids`` all of the request's, the cached
        ones first); the workers open the room next step for those past the cached prefix.
        Prefill: a request to send is scheduled for the first time (see :meth:`scheduled`)."""
        if self.is_prefill:
            if request.request_id in self.prefilling or request.request_id in self.in_flight:
                return
            plan = self._plan(request)
            if plan is not None:
                self.prefilling[request.request_id] = _Prefilling(
                    plan.base_id, plan.transfer_id, len(request.prompt_token_ids or ())
                )
            return
        if num_external_tokens == 0 or request.request_id in self.asked:
            return
        plan = self._plan(request)
        if plan is None:  # matched() refused it too: vLLM asked for no load
            return
        prefix = len(request.prompt_token_ids or ()) - num_external_tokens
        first = prefix // self.block_size
        transfer = Transfer(
            request.request_id,
            plan.transfer_id,
            tuple(block_ids[first : self._num_blocks(request)]),
            plan.bootstrap,
            prefix,
        )
        self.asked.add(request.request_id)
        self.in_flight[request.request_id] = transfer
        self.pending.start.append(transfer)

    def scheduled(self, output: SchedulerOutput) -> None:
        """Prefill: a request whose last prompt tokens this step computes starts its layer-wise send
        (its blocks are all allocated now); vLLM writes its KV layer by layer in this step."""
        if not self.prefilling:
            return
        steps: list[tuple[str, list[int] | None, bool, int]] = [
            (new.req_id, list(new.block_ids[0]), True, new.num_computed_tokens)
            for new in output.scheduled_new_reqs
        ]
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            blocks = None if new_blocks is None else list(new_blocks[0])
            steps.append((req_id, blocks, req_id in cached.resumed_req_ids, cached.num_computed_tokens[i]))
        for req_id, blocks, replace, computed in steps:
            prefilling = self.prefilling.get(req_id)
            if prefilling is None:
                continue
            if blocks is not None:
                prefilling.block_ids = blocks if replace else prefilling.block_ids + blocks
            if computed + output.num_scheduled_tokens.get(req_id, 0) < prefilling.num_tokens:
                continue
            del self.prefilling[req_id]
            num_blocks = -(-prefilling.num_tokens // self.block_size)
            transfer = Transfer(req_id, prefilling.transfer_id, tuple(prefilling.block_ids[:num_blocks]))
            self.layerwise.add(req_id)
            self.in_flight[req_id] = transfer
            self.pending.layerwise.append(transfer)

    def ended(self, req_ids: Iterable[str]) -> None:
        """The workers reported these requests' rooms ended."""
        for req_id in req_ids:
            self.in_flight.pop(req_id, None)

    def sent(self, req_ids: set[str]) -> set[str]:
        """Prefill: these requests' rooms ended. Returns those whose blocks vLLM may free now: a
        layer-wise room can end while its request still runs (vLLM frees only finished requests'
        blocks on ``finished_sending``), so the others are kept and freed when they finish."""
        self.ended(req_ids)
        running = req_ids & self.layerwise
        self.sent_early |= running
        return req_ids - running

    def reply(self, base_id: str) -> dict[str, Any]:
        """Prefill: the ``kv_transfer_params`` a finished request returns, for its decode."""
        return {
            "do_remote_prefill": True,
            "transfer_id": base_id,
            "bootstrap": self.bootstrap,
            "tp_size": self.tp_size,
            "block_size": self.block_size,
        }

    def finished(self, request: RequestView, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: (hold the blocks?, kv_transfer_params for the response)."""
        req_id = request.request_id
        asked = req_id in self.asked
        self.asked.discard(req_id)
        self.warned.discard(req_id)
        if self.is_prefill:
            prefilling = self.prefilling.pop(req_id, None)
            if req_id in self.layerwise:  # its room opened: hold the blocks until it ended
                self.layerwise.discard(req_id)
                done = req_id in self.sent_early
                self.sent_early.discard(req_id)
                transfer = self.in_flight.get(req_id)
                if request.status in FINISHED_OK:
                    plan, _ = plan_of(
                        req_id, request.kv_transfer_params, is_prefill=True, block_size=self.block_size
                    )
                    return not done, None if plan is None else self.reply(plan.base_id)
                if not done and transfer is not None:
                    self.pending.abort.append(transfer)
                return not done, None
            if prefilling is None:  # not seen scheduled: planned now
                plan, _ = plan_of(
                    req_id, request.kv_transfer_params, is_prefill=True, block_size=self.block_size
                )
            else:
                plan = Plan(prefilling.base_id, prefilling.transfer_id)
            if plan is None:
                return False, None
            transfer = Transfer(req_id, plan.transfer_id, tuple(block_ids[: self._num_blocks(request)]))
            if request.status in FINISHED_OK:
                self.in_flight[req_id] = transfer
                self.pending.start.append(transfer)
                return True, self.reply(plan.base_id)
            self.pending.abort.append(transfer)  # the workers fail the room; the blocks free now
            return False, None
        receiving = self.in_flight.get(req_id)
        if receiving is not None:  # its room may still take WRITEs: hold the blocks until it ended
            self.pending.abort.append(receiving)
            return True, None
        if not asked:
            plan, _ = plan_of(
                req_id, request.kv_transfer_params, is_prefill=False, block_size=self.block_size
            )
            if plan is not None:  # ended before its blocks were allocated: tell the prefill
                self.pending.cancel.append(Transfer(req_id, plan.transfer_id, (), plan.bootstrap))
        return False, None

    def take_meta(self) -> TransferMetadata:
        meta, self.pending = self.pending, TransferMetadata()
        return meta

    def has_work(self) -> bool:
        p = self.pending
        return bool(self.in_flight or p.start or p.layerwise or p.abort or p.cancel)


@dataclass
class _Prefilling:
    base_id: str
    transfer_id: str
    num_tokens: int
    block_ids: list[int] = field(default_factory=list)
