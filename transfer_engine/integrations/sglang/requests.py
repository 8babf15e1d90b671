"""The KVSender (prefill) and KVReceiver (decode) of one request, one TP rank each."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import (
    BaseKVReceiver,
    BaseKVSender,
    KVTransferDestination,
    KVTransferMetric,
)

from transfer_engine import ConfigError, FailureReason, LocalProtocolError, RoomStatus, TransferFailed
from transfer_engine.facade import BlockingReceiver
from transfer_engine.integrations.sglang.settings import registry_endpoint

if TYPE_CHECKING:
    from transfer_engine.integrations.sglang.manager import KVManager

__all__ = ["KVReceiver", "KVSender"]

_ENDED = (RoomStatus.SUCCESS, RoomStatus.FAILED)


def _raise_failure(handle: Any, room: int) -> None:
    """Raise ``handle``'s TransferFailed; if this rank's room has not failed, another rank's has.

    SGLang combines poll() over the TP group with MIN, so it calls this on every rank once any rank
    said Failed. A rank whose own room is still live is aborted (so it ends, and frees nothing
    late) and raises a TransferFailed marked ``is_from_another_rank`` (SGLang logs those quietly).
    """
    error = handle.failure_error() if handle is not None else None
    if error is None:
        if handle is not None:
            handle.abort("failed on another rank of the TP group")
        error = TransferFailed(room, FailureReason.REMOTE, "failed on another rank of the TP group")
        error.is_from_another_rank = True  # type: ignore[attr-defined]
    raise error


def _pages(kv_indices: Any) -> np.ndarray:
    return np.asarray(kv_indices.cpu() if hasattr(kv_indices, "cpu") else kv_indices)


class KVSender(BaseKVSender):
    """Prefill side of one request; see the conn module's docstring. Construction opens the room."""

    def __init__(
        self,
        mgr: KVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self._sender = mgr.engine.sender(bootstrap_room)
        self._aux_index: int | None = None
        self._total: int | None = None
        self._sent = 0
        self._started = time.monotonic()
        self._latency: float | None = None

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """The request's page count (after the decode's prefix) and its aux slot; before any send()."""
        if self.kv_mgr.aux is not None and aux_index is not None:
            self.kv_mgr.aux._check(aux_index)
        self._sender.expect(num_kv_indices, aux_index)
        self._total = num_kv_indices
        self._aux_index = aux_index

    def send(
        self,
        kv_indices: Any,
        state_indices: Sequence[Any] | None = None,
        num_kv_tokens: int | None = None,
        indices_event: torch.cuda.Event | None = None,
    ) -> None:
        """One chunk: the prefill's page indices of it (int32 or int64), in request order.

        Once the room has failed this does nothing (SGLang keeps sending the chunks of a request
        whose transfer failed; it learns of the failure from poll()). Bad input still raises.
        """
        if state_indices is not None and any(s is not None and len(s) for s in state_indices):
            raise ConfigError(f"state_indices={state_indices!r}: hybrid-model state is not supported")
        if self._total is None:
            raise LocalProtocolError(f"room {self.bootstrap_room}: send() before init()")
        if indices_event is not None:
            indices_event.synchronize()  # the page indices are being copied to the host
        pages = _pages(kv_indices)
        if self._sender.failure is not None:
            return
        last = self._sent + pages.size == self._total
        if last and self._aux_index is not None and self.kv_mgr.aux is not None:
            self.kv_mgr.aux.pack(self._aux_index)
        try:
            self._sender.send(pages)
        except LocalProtocolError:
            if self._sender.failure is None:
                raise
            return  # it failed between the check and the send
        self._sent += pages.size

    def pop_decode_prefix_len(self) -> int:
        return self._sender.decode_prefix_len

    def poll(self) -> RoomStatus:
        status = self._sender.poll()
        if status is RoomStatus.SUCCESS and self._latency is None:
            self._latency = time.monotonic() - self._started
        return status

    def failure_exception(self) -> None:
        """Raise the room's typed TransferFailed (see ``_raise_failure`` for a room failed elsewhere)."""
        _raise_failure(self._sender, self.bootstrap_room)

    def abort(self) -> None:
        self._sender.abort("aborted by the SGLang scheduler")

    def get_transfer_metric(self) -> KVTransferMetric:
        pool = self.kv_mgr.pool
        return KVTransferMetric(
            transfer_latency_s=self._latency,
            transfer_total_bytes=self._sent * pool.page_bytes * pool.layout.num_kv_tensors,
        )


class KVReceiver(BaseKVReceiver):
    """Decode side of one request; see the conn module's docstring. ``init()`` starts the handshake."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        if bootstrap_room is None:
            raise ConfigError("bootstrap_room=None: every request needs a room id")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self._rx: BlockingReceiver | None = None
        self._aux_index: int | None = None
        self._unpacked = False
        self.abort_notified = False
        """SGLang's deferred release reads it: True once this rank's room was told to stop."""
        self.init_time: float | None = None

    @property
    def bootstrap_infos(self) -> list[str]:
        """SGLang counts these as the acknowledgements to wait for; the room's end includes them."""
        return [self.bootstrap_addr]

    def init(self, prefill_dp_rank: int = 0) -> None:
        """Start the handshake with the prefill instance; poll() says WaitingForInput once done."""
        if prefill_dp_rank not in (0, None):
            raise ConfigError(f"prefill_dp_rank={prefill_dp_rank}: prefill attention-DP is not supported")
        if self._rx is not None:
            raise LocalProtocolError(f"room {self.bootstrap_room}: init() called twice")
        self._rx = self.kv_mgr.engine.receiver(self.bootstrap_room, registry_endpoint(self.bootstrap_addr))

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Sequence[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
    ) -> None:
        """This rank's pages for the request's tokens after ``decode_prefix_len``; after WaitingForInput.

        Does nothing once the room has failed (poll() reports it); bad input still raises.
        """
        if state_indices is not None and any(s is not None and len(s) for s in state_indices):
            raise ConfigError(f"state_indices={state_indices!r}: hybrid-model state is not supported")
        if destination != KVTransferDestination.DEVICE:
            raise ConfigError(f"destination={destination!r}: only device destinations are supported")
        if self._rx is None:
            raise LocalProtocolError(f"room {self.bootstrap_room}: send_metadata() before init()")
        if self.kv_mgr.aux is not None and aux_index is not None:
            self.kv_mgr.aux._check(aux_index)
        pages = _pages(kv_indices)
        if self._rx.failure is not None:
            return
        try:
            self._rx.request(
                pages, aux_index if self.kv_mgr.aux is not None else None, decode_prefix_len or 0
            )
        except LocalProtocolError:
            if self._rx.failure is None:
                raise
            return  # it failed between the check and the request
        self._aux_index = aux_index
        self.init_time = time.monotonic()

    def poll(self) -> RoomStatus:
        if self._rx is None:
            return RoomStatus.BOOTSTRAPPING
        status = self._rx.poll()
        if status is RoomStatus.SUCCESS and not self._unpacked:
            if self._aux_index is not None and self.kv_mgr.aux is not None:
                self.kv_mgr.aux.unpack(self._aux_index)
            self._unpacked = True
        return status

    def ended(self) -> bool:
        """Whether this rank's room has ended: no WRITE of it can land in its pages any more."""
        return self._rx is None or self._rx.poll() in _ENDED

    def failure_exception(self) -> None:
        """Raise the room's typed TransferFailed (see ``_raise_failure`` for a room failed elsewhere)."""
        _raise_failure(self._rx, self.bootstrap_room)

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """SGLang's deferred release: stop this rank's room (if live) and hold its pages until it ended."""
        if self.abort_notified:
            return
        if self._rx is not None and self._rx.poll() not in _ENDED:
            self._rx.abort("failed on a rank of the TP group")
        self.kv_mgr.hold(self)
        self.abort_notified = True

    def abort(self) -> None:
        if self._rx is not None:
            self._rx.abort("aborted by the SGLang scheduler")
        self.kv_mgr.hold(self)
        self.abort_notified = True

    def clear(self) -> None:
        self.kv_mgr.clear_deferred_abort_state(self.bootstrap_room)
