"""The caller's handles on one room: :class:`Sender` (prefill) and :class:`Receiver` (decode), over
their abstract base :class:`RoomHandle` (the checks of their arguments: :mod:`transfer_engine.engine.checks`).

A handle reads its room's status and failure (never blocking, from any thread) and mails the room
what the caller asks for; the room actor alone changes the room.

Every CUDA event a handle mails for a thread to wait on is blocking (:class:`~transfer_engine.events.BlockingEvent`):
the completion waiter's ``synchronize()`` then sleeps in the driver. A caller's own ``ready=`` event
(non-blocking unless made so) is not waited on as given: a side stream of the pool's device is made to
wait for it and a blocking event recorded there after it stands in for it
(:func:`~transfer_engine.events.blocking`; docs/DECISIONS.md, "An idle poller looks four times a
second"). An event made by :func:`~transfer_engine.facade.recorded` is blocking already and goes as it is.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
import torch

from transfer_engine.actors.room import ReceiverRoomActor, RoomActor, SenderRoomActor
from transfer_engine.engine.checks import check_pages, pages_array
from transfer_engine.errors import ConfigError, FailureReason, LocalProtocolError, TransferFailed
from transfer_engine.events import Completion, blocking, blocking_event, recorded
from transfer_engine.memory.layout import KVPool
from transfer_engine.protocol.layers import LayerChunks
from transfer_engine.protocol.polling import polled
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.runtime.mail import (
    LayersReady,
    LocalAbort,
    MailboxOverflow,
    QueueChunk,
    Ready,
    RequestPages,
    RoomMail,
)


class RoomHandle(ABC):
    """What both handles share: the room's status and failure, waiting for its end, aborting it,
    and mailing it (the blocking facade validates on its callers' threads and mails from the loop).
    Abstract: a handle is a :class:`Sender` or a :class:`Receiver`, each over its side's actor."""

    def __init__(self, actor: RoomActor) -> None:
        self._live = RoomStatus.BOOTSTRAPPING if actor.status.final else actor.status

    @property
    @abstractmethod
    def _actor(self) -> RoomActor:
        """The room's actor (the only one that changes the room; the handle reads and mails it)."""

    @property
    def room(self) -> int:
        return self._actor.room

    def poll(self) -> RoomStatus:
        """The room's status now; never blocks, and may be called from any thread (it only reads).

        Success and Failed are reported only once the room has ended (final AND quiescent): from
        then on no WRITE of it can land, so a caller that acts on poll() alone may free or reuse
        the room's pages at once. A room that failed but still waits for WRITEs or AbortAcks
        keeps reporting the last status this handle saw before (``failure`` already says why).
        """
        status = self._actor.status
        if not status.final:
            self._live = status
            return status
        return polled(status, self._actor.done.is_set(), self._live)

    @property
    def status(self) -> RoomStatus:
        """The room's status as its actor last set it: final as soon as decided, even while WRITEs
        of it may still land (:meth:`poll` says when that is over)."""
        return self._actor.status

    @property
    def failure(self) -> tuple[FailureReason, str] | None:
        """``(reason, detail)`` as soon as the room failed (before poll() reports it), else None."""
        f = self._actor.core.failure
        return None if f is None else (f.reason, f.detail)

    async def ended(self) -> TransferFailed | None:
        """Wait until the room ended (final and nothing of it in flight); its error, or None on success."""
        await self._actor.done.wait()
        return self._actor.error()

    async def wait(self) -> None:
        """Return once the room succeeded and nothing of it is in flight; raise TransferFailed otherwise."""
        await self._actor.done.wait()
        self._actor.ports.me.trace.mark(self.room, "waited")
        error = self._actor.error()
        if error is not None:
            raise error

    def deliver_nowait(self, mail: RoomMail) -> None:
        """Queue ``mail`` (from :meth:`Sender.prepare_chunk`, :meth:`Sender.prepare_layers`, or a
        LocalAbort) for the room, on the loop; anyio.WouldBlock when its mailbox is full, and
        anyio.ClosedResourceError once the room ended."""
        self._actor.inbox.send_nowait(mail)

    async def deliver(self, mail: RoomMail) -> None:
        """Queue ``mail`` for the room, waiting while its mailbox is full; anyio.ClosedResourceError
        once the room ended (see :meth:`deliver_nowait`)."""
        await self._actor.inbox.send(mail)

    async def wait_bootstrapped(self) -> None:
        """Return once the room has left Bootstrapping: on a prefill, every decode rank's
        TransferRequest is in (WaitingForInput, or further on after an early ``send()``); a decode
        room has left it when :meth:`TransferEngine.receiver` returns. Raises the room's
        TransferFailed if it failed instead, once nothing of it is in flight (as :meth:`wait`).

        The awaitable form of polling until ``poll()`` is no longer BOOTSTRAPPING: it returns as the
        room's mail changes the status, with no polling interval added to the room's latency.
        """
        actor = self._actor
        while actor.status is RoomStatus.BOOTSTRAPPING and not actor.done.is_set():
            await actor.status_changed.wait()
        if actor.status is RoomStatus.FAILED:
            await self.wait()

    async def abort(self, detail: str = "aborted by the application") -> None:
        """Stop the room at any point; returns when no WRITE of it can still land. Idempotent."""
        if not self._actor.done.is_set():
            try:
                await self._actor.inbox.send(LocalAbort(detail))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass
        await self._actor.done.wait()


class Sender(RoomHandle):
    """Prefill side of one room. Created by :meth:`TransferEngine.sender`.

    Chunks go out in ``send()`` order. The last one is marked by ``last=True``, or, once
    :meth:`expect` gave the room's page count, by the page count reaching it.
    """

    def __init__(
        self,
        actor: SenderRoomActor,
        pool: KVPool,
        layers_per_write: int = 4,
    ) -> None:
        super().__init__(actor)
        self._room_actor = actor
        self._pool = pool
        self._sealed = False
        self._total: int | None = None
        self._aux_slot: int | None = None
        self._sent = 0
        self._chunks = 0
        self._layers = LayerChunks(pool.layout.num_layers, layers_per_write)
        self._waits: list[Completion] = []
        """The ``ready`` of each layers_ready() call since the last group went out (None left out)."""
        self._pending_stream: torch.cuda.Stream | None = None
        """CUDA: the stream of the layers_ready() calls without ``ready`` since the last event recorded
        for them; one event on it, recorded when the group closes (or the caller's stream changes),
        covers them all."""

    @property
    def _actor(self) -> SenderRoomActor:
        return self._room_actor

    @property
    def decode_prefix_len(self) -> int:
        """Tokens the decode side already holds (0 until its requests arrived): send only the rest.

        Pages given to ``send()`` are those of tokens ``decode_prefix_len`` onwards, in order.
        """
        return self._room_actor.decode_prefix_len

    def expect(self, total_pages: int, aux_slot: int | None = None) -> None:
        """Declare the room's page count (and the aux slot of its last chunk) before its last chunk.

        From then on ``send(pages)`` marks the chunk that reaches ``total_pages`` as the last and
        refuses pages beyond it. ConfigError for a count below the pages already sent, LayoutError
        for an aux slot outside the pool, LocalProtocolError after the last chunk or a second call.
        """
        if not isinstance(total_pages, int) or isinstance(total_pages, bool) or total_pages < 1:
            raise ConfigError(f"total_pages={total_pages!r} must be a positive integer")
        self._pool.check_aux_slot(aux_slot)
        if self._sealed:
            raise LocalProtocolError(f"room {self.room} already sent its last chunk")
        if self._total is not None:
            raise LocalProtocolError(f"room {self.room} already expects {self._total} pages")
        if total_pages <= self._sent:
            raise ConfigError(
                f"total_pages={total_pages} but room {self.room} already sent {self._sent} pages"
            )
        self._total = total_pages
        self._aux_slot = aux_slot

    def prepare_chunk(
        self,
        pages: Sequence[int] | np.ndarray | Any,
        last: bool | None,
        aux_slot: int | None,
        ready: torch.cuda.Event | None,
        layerwise: bool = False,
    ) -> QueueChunk:
        """Validate one send() (or begin_chunk()) and return its mail, to :meth:`deliver` in order;
        changes this handle's counts only when valid. For a caller that validates on its own thread
        and mails from the loop (the blocking facade); errors as for :meth:`send`."""
        arr = pages_array(pages, self._pool, "pages")
        self._pool.check_aux_slot(aux_slot)
        self._layers.check_open(self._chunks)
        if self._sealed:
            raise LocalProtocolError(f"room {self.room} already sent its last chunk")
        if self._actor.done.is_set() or self._actor.status.final:
            raise LocalProtocolError(f"room {self.room} is {self._actor.status.name}; send() is not allowed")
        sent = self._sent + arr.size
        if self._total is not None:
            if sent > self._total:
                raise ConfigError(
                    f"{arr.size} pages would make {sent}, over the room's total_pages={self._total}"
                )
            if last is not None and last != (sent == self._total):
                raise ConfigError(
                    f"last={last} but the room has sent {sent} of total_pages={self._total} pages"
                )
            last = sent == self._total
            if aux_slot is None:
                aux_slot = self._aux_slot
        last = bool(last)
        if ready is None and self._pool.device.type == "cuda" and not layerwise:
            # the KV of this chunk is written by work queued so far on the caller's stream
            ready = recorded(torch.cuda.current_stream(self._pool.device))
        elif isinstance(ready, torch.cuda.Event):  # the caller's: waited on through a blocking event after it
            ready = blocking_event(ready, self._pool.device)
        if layerwise:
            self._layers.open(self._chunks)
        self._sealed = last
        self._sent = sent
        self._chunks += 1
        return QueueChunk(arr, last, aux_slot, ready, layerwise)

    def prepare_layers(self, start: int, end: int, ready: Ready) -> LayersReady | None:
        """Validate one layers_ready() and return the group's mail when a group is complete (else
        None), to :meth:`deliver`; changes nothing when invalid. For callers that mail from the loop
        (see :meth:`prepare_chunk`); errors as for :meth:`layers_ready`.

        Called once per layer from inside a forward, so it does no more than it must: on CUDA a call
        without ``ready`` records no event unless it closes a group (or the caller's current stream
        changed since the last such call): work queued on a stream is ordered, so the one event
        recorded when the group closes covers every layer of the group that stream wrote.
        """
        status = self._actor.status
        # A rank that writes nothing to any decode rank of the room succeeds once its last chunk is
        # queued; the layers of that chunk are still reported (and validated), and go nowhere.
        writes_nothing = status is RoomStatus.SUCCESS and self._layers.is_open
        if (self._actor.done.is_set() or status.final) and not writes_nothing:
            raise LocalProtocolError(f"room {self.room} is {status.name}; layers_ready() is not allowed")
        self._layers.check_ready(start, end)
        cuda = self._pool.device.type == "cuda"
        if ready is not None and not isinstance(ready, threading.Event | torch.cuda.Event):
            raise ConfigError(f"ready={ready!r} must be a torch.cuda.Event, a threading.Event or None")
        if isinstance(ready, torch.cuda.Event) and not cuda:
            raise ConfigError(f"ready={ready!r} is a CUDA event but this KV pool is on {self._pool.device}")
        group = self._layers.ready(start, end)
        if ready is not None:
            self._waits.append(ready)
        elif cuda:
            # the layers are written by work queued so far on the caller's stream
            stream = torch.cuda.current_stream(self._pool.device)
            if self._pending_stream is not None and self._pending_stream != stream:
                self._waits.append(recorded(self._pending_stream))
            self._pending_stream = stream
        if group is None:
            return None
        if self._pending_stream is not None:
            self._waits.append(recorded(self._pending_stream))
            self._pending_stream = None
        waits, self._waits = self._waits, []
        if writes_nothing:
            return None
        # the caller's CUDA events: one blocking event after them all (module docstring)
        return LayersReady(group, blocking(waits, self._pool.device) if cuda else tuple(waits))

    async def begin_chunk(
        self, pages: Sequence[int] | np.ndarray | Any, last: bool | None = None, aux_slot: int | None = None
    ) -> None:
        """Open the next chunk for layer-wise sending: its pages, ``last`` and ``aux_slot`` as for
        :meth:`send`, but nothing is written until :meth:`layers_ready` reports its layers.

        Errors as for :meth:`send`, and LocalProtocolError while another layer-wise chunk is still
        open (its layers must all be ready first). Nothing is queued then.
        """
        await self._mail(self.prepare_chunk(pages, last, aux_slot, None, layerwise=True))

    async def layers_ready(self, start: int, end: int, *, ready: Ready = None) -> None:
        """Layers ``[start, end)`` of the open chunk are written (once ``ready`` completes). Returns at once.

        Ranges come in layer order, back to back from layer 0; the one ending at ``num_layers``
        closes the chunk (it then counts as a :meth:`send` of its pages, and the aux item of the
        last chunk follows it). Ready layers go out in groups of at least ``layers_per_write``
        (``EngineConfig``), one WRITE per decode rank, as soon as every ``ready`` of the group has
        completed, while the caller's forward goes on.

        ``ready``: on CUDA, an event recorded after the kernels that wrote the layers (None: the
        work queued so far on the caller's current stream; one event per group and stream is
        recorded for such calls, when the group closes, so a call that closes no group records
        nothing); the group's own events, if not blocking, are waited on through one blocking event
        recorded after them all when the group closes (module docstring); on CPU, a ``threading.Event`` the writing thread sets, or None when the layers are
        written already. Called once per layer from a forward: a call costs microseconds and wakes
        nothing unless it closes a group. ConfigError for a range outside
        ``[0, num_layers]`` or a bad ``ready``; LocalProtocolError when no chunk is open, the range
        does not start where the last one ended, or the room is final. Nothing is queued then.
        """
        mail = self.prepare_layers(start, end, ready)
        if mail is not None:
            await self._mail(mail)

    async def _mail(self, mail: RoomMail) -> None:
        try:
            await self._actor.inbox.send(mail)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise LocalProtocolError(
                f"room {self.room} is {self._actor.status.name}; sending is not allowed"
            ) from None

    async def send(
        self,
        pages: Sequence[int] | np.ndarray | Any,
        last: bool | None = None,
        aux_slot: int | None = None,
        *,
        ready: torch.cuda.Event | None = None,
    ) -> None:
        """Queue the next chunk: the prefill's KV page indices of it, in request order. Returns at once.

        ``last`` None means False, or, after :meth:`expect`, whether this chunk reaches the total.
        ``ready``: a CUDA event after which the chunk's KV is written (for a caller on another
        thread or stream; if not blocking, it is waited on through a blocking event recorded after
        it, module docstring); without it, an event is recorded on the caller's current stream.
        Raises LayoutError/ConfigError for pages or an aux slot outside the pool or past the
        expected total, and LocalProtocolError after the last chunk or once the room is final.
        Nothing is queued then.
        """
        self._actor.ports.me.trace.mark(self.room, "send")
        chunk = self.prepare_chunk(pages, last, aux_slot, ready)
        try:
            await self._actor.inbox.send(chunk)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            # the room ended while send() waited for its turn (an abort came in): nothing (more) was
            # queued, and the room is final
            raise LocalProtocolError(
                f"room {self.room} is {self._actor.status.name}; send() is not allowed"
            ) from None


class Receiver(RoomHandle):
    """Decode side of one room. Created by :meth:`TransferEngine.receiver`.

    Opened without pages, the room handshakes and waits in WaitingForInput until :meth:`request`
    gives them (SGLang's order: pages are allocated only once the handshake is done).
    """

    def __init__(self, actor: ReceiverRoomActor, pool: KVPool) -> None:
        super().__init__(actor)
        self._room_actor = actor
        self._pool = pool
        self._requested = False

    @property
    def _actor(self) -> ReceiverRoomActor:
        return self._room_actor

    @property
    def requested(self) -> bool:
        """Whether the room's pages were given (its TransferRequests go out, or went out)."""
        return self._requested or self._room_actor.requested

    def request(
        self,
        pages: Sequence[int] | np.ndarray | Any,
        aux_slot: int | None = None,
        decode_prefix_len: int = 0,
    ) -> None:
        """Give the room its pages and ask every prefill rank for the KV; returns at once.

        ``pages``: this rank's page indices for the request's tokens from ``decode_prefix_len`` on
        (the decode already holds the first ``decode_prefix_len`` tokens, a multiple of the page
        size; the prefill sends only the rest). Call once, on the event loop, while the room is in
        WaitingForInput. Bad arguments raise ConfigError/LayoutError naming the value, a second
        call or a final room LocalProtocolError; nothing is sent then. The room sends its
        TransferRequests when it takes the pages from its mailbox.
        """
        self.give_pages(
            check_pages(self._pool, pages, aux_slot, decode_prefix_len), aux_slot, decode_prefix_len
        )

    def give_pages(self, pages: np.ndarray, aux_slot: int | None, decode_prefix_len: int) -> None:
        """:meth:`request` with ``pages`` that :func:`~transfer_engine.engine.checks.check_pages`
        returned for these arguments."""
        actor = self._room_actor
        if self.requested:
            raise LocalProtocolError(f"room {self.room} already requested its pages")
        if actor.done.is_set() or actor.status is not RoomStatus.WAITING_FOR_INPUT:
            raise LocalProtocolError(
                f"room {self.room} is {actor.status.name}; request() needs WAITING_FOR_INPUT"
            )
        try:
            actor.inbox.post(RequestPages(pages, aux_slot, decode_prefix_len))
        except (anyio.ClosedResourceError, MailboxOverflow):
            raise LocalProtocolError(
                f"room {self.room} is {actor.status.name}; request() is not allowed"
            ) from None
        self._requested = True
