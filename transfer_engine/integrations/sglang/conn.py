"""SGLang's KV transfer contract on top of the blocking facade.

SGLang's scheduler is synchronous: one thread per TP rank creates senders and receivers and calls
``init``, ``send``/``send_metadata``, ``poll``, ``failure_exception`` and ``abort`` once per step;
it combines ``poll()`` across its TP group with an all-reduce MIN. Here every one of those calls
returns without waiting for I/O (see :mod:`transfer_engine.facade`); only constructing a
:class:`KVSender` waits for one synchronous step of the engine's loop.

``poll()`` returns :class:`~transfer_engine.RoomStatus` values, which equal ``KVPoll``'s.
Success and Failed mean the room has ended: no WRITE of it can still land, so the scheduler may free
(and reuse) the request's pages at once, as it does.

What maps to what:

- ``KVArgs.kv_data_ptrs/lens/item_lens`` become the engine's pool
  (:func:`~transfer_engine.memory.views.pool_from_pointers`); the aux buffers are packed per slot
  (:class:`~transfer_engine.memory.views.AuxBuffers`): the prefill packs a request's aux slot as it
  sends the last chunk, the decode unpacks it when its poll() first says Success.
- The bootstrap address ``host:port`` is the engine's bootstrap registry at ``tcp://host:port``,
  run by :class:`KVBootstrapServer` beside the prefill's HTTP server.
- ``KVSender.init(num_kv_indices, aux_index)`` is ``Sender.expect``; each ``send(kv_indices)`` is a
  chunk, the last one being the one that reaches ``num_kv_indices``.
- ``KVReceiver.init(prefill_dp_rank)`` starts the handshake; ``send_metadata(kv_indices,
  aux_index, state_indices, decode_prefix_len)`` is ``Receiver.request``. The prefill learns
  ``decode_prefix_len`` through ``pop_decode_prefix_len()`` and sends only the rest, as SGLang does.

Not supported (typed errors naming the value): hybrid-model state buffers (``state_indices``),
host destinations, prefill instances with attention data parallelism (``prefill_dp_rank`` > 0),
and pipeline-parallel prefill.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.from_thread
import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVTransferDestination,
    KVTransferMetric,
)

from transfer_engine.actors.bootstrap import Bootstrap
from transfer_engine.config import EngineConfig
from transfer_engine.errors import ConfigError, FailureReason, LayoutError, LocalProtocolError, TransferFailed
from transfer_engine.facade import BlockingEngine, BlockingReceiver
from transfer_engine.memory.layout import KVLayout, KVPool, dtype_of
from transfer_engine.memory.views import AuxBuffers, pool_from_pointers
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.transport.security import Curve

__all__ = ["KVBootstrapServer", "KVManager", "KVReceiver", "KVSender", "PrefillInfo", "layout_from_kv_args"]

log = logging.getLogger(__name__)


def _mode(disaggregation_mode: Any) -> str:
    mode = str(getattr(disaggregation_mode, "value", disaggregation_mode)).lower()
    if mode not in ("prefill", "decode"):
        raise ConfigError(f"disaggregation_mode={disaggregation_mode!r} must be prefill or decode")
    return mode


def attn_tp_size(server_args: Any) -> int:
    """The TP size of one attention group: ``tp_size``, divided by ``dp_size`` under DP attention."""
    tp = int(server_args.tp_size)
    if getattr(server_args, "enable_dp_attention", False):
        tp //= int(getattr(server_args, "dp_size", 1))
    return tp


def layout_from_kv_args(args: KVArgs, is_mla: bool) -> KVLayout:
    """The engine's layout from SGLang's ``KVArgs``: layers, heads, head_dim and dtype of the buffers."""
    dtype = dtype_of(str(args.kv_cache_dtype_str).removeprefix("torch."))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    ptrs, items = list(args.kv_data_ptrs), list(args.kv_item_lens)
    if not ptrs or not items:
        raise LayoutError("KVArgs.kv_data_ptrs and kv_item_lens must be non-empty")
    page_size = int(args.page_size)
    if is_mla:
        return KVLayout(len(ptrs), 1, items[0] // (page_size * itemsize), dtype, page_size, mla=True)
    if len(ptrs) % 2:
        raise LayoutError(f"{len(ptrs)} kv_data_ptrs: an MHA pool has K then V buffers, an even count")
    heads_local = int(args.kv_head_num)
    head_dim, rest = divmod(items[0], page_size * heads_local * itemsize)
    if rest or head_dim < 1:
        raise LayoutError(
            f"kv_item_lens[0]={items[0]} is not page_size={page_size} x kv_head_num={heads_local} x "
            f"head_dim x {itemsize} bytes for any head_dim"
        )
    return KVLayout(len(ptrs) // 2, int(args.total_kv_head_num), head_dim, dtype, page_size)


@dataclass(frozen=True)
class PrefillInfo:
    """What SGLang's decode scheduler reads of a prefill instance (``kv_manager.prefill_info_table``)."""

    dp_size: int = 1
    follow_bootstrap_room: bool = True


class KVManager(BaseKVManager):
    """One TP rank's engine, built from SGLang's ``KVArgs``; created once per scheduler.

    ``server_args`` is read for ``tp_size`` (``dp_size`` with ``enable_dp_attention``), ``device``,
    ``disaggregation_bootstrap_port`` and ``host``. Everything else comes from ``TE_*`` environment
    variables (:meth:`EngineConfig.from_env`), or from ``config`` when given (tests).
    """

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
        *,
        config: EngineConfig | None = None,
    ) -> None:
        self.kv_args = args
        self.role = _mode(disaggregation_mode)
        self.is_mla_backend = bool(is_mla_backend)
        tp_size = attn_tp_size(server_args)
        layout = layout_from_kv_args(args, self.is_mla_backend)
        device = str(getattr(server_args, "device", "cuda"))
        if device == "cuda":
            device = f"cuda:{int(getattr(args, 'gpu_id', 0))}"
        self.aux: AuxBuffers | None = None
        if list(getattr(args, "aux_data_ptrs", []) or []):
            self.aux = AuxBuffers(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, device="cpu")
        self.pool: KVPool = pool_from_pointers(
            layout, tp_size, int(args.engine_rank), args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens,
            device=device, aux=None if self.aux is None else self.aux.packed,
        )  # fmt: skip
        if config is None:
            config = EngineConfig.from_env(
                role=self.role,
                tp_size=tp_size,
                tp_rank=int(args.engine_rank),
                bootstrap_host=_connect_host(str(getattr(server_args, "host", "127.0.0.1"))),
                bootstrap_port=int(server_args.disaggregation_bootstrap_port),
                host_bootstrap=False,
            )
        self.config = config
        self.engine = BlockingEngine(config, self.pool)
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._lock = threading.Lock()

    def register_to_bootstrap(self) -> None:
        """Nothing to do: a prefill engine registers with the bootstrap registry as it starts."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's decode asks this before creating receivers; each receiver handshakes itself."""
        with self._lock:
            self.prefill_info_table.setdefault(bootstrap_addr, PrefillInfo())
        return True

    def close(self) -> None:
        """Stop the engine (live rooms fail with SHUTDOWN); its thread and NIXL agent are gone after."""
        self.engine.close()

    teardown = close


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _endpoint(bootstrap_addr: str) -> str:
    addr = bootstrap_addr.removeprefix("tcp://")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"bootstrap_addr={bootstrap_addr!r} must be host:port")
    return f"tcp://{_connect_host(host)}:{port}"


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


class KVSender(BaseKVSender):
    """Prefill side of one request; see the module docstring. Construction opens the room."""

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
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
        indices_event: torch.cuda.Event | None = None,
    ) -> None:
        """One chunk: the prefill's page indices of it (int32 or int64), in request order.

        Once the room has failed this does nothing (SGLang keeps sending the chunks of a request
        whose transfer failed; it learns of the failure from poll()). Bad input still raises.
        """
        if state_indices:
            raise ConfigError(f"state_indices={state_indices!r}: hybrid-model state is not supported")
        if self._total is None:
            raise LocalProtocolError(f"room {self.bootstrap_room}: send() before init()")
        if indices_event is not None:
            indices_event.synchronize()  # the page indices are being copied to the host
        pages = np.asarray(kv_indices.cpu() if hasattr(kv_indices, "cpu") else kv_indices)
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
    """Decode side of one request; see the module docstring. ``init()`` starts the handshake."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        if bootstrap_room is None:
            raise ConfigError("bootstrap_room=None: every request needs a room id")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self._rx: BlockingReceiver | None = None
        self._refused: TransferFailed | None = None
        self._aux_index: int | None = None
        self._unpacked = False

    def init(self, prefill_dp_rank: int = 0) -> None:
        """Start the handshake with the prefill instance; poll() says WaitingForInput once done."""
        if prefill_dp_rank not in (0, None):
            raise ConfigError(f"prefill_dp_rank={prefill_dp_rank}: prefill attention-DP is not supported")
        if self._rx is not None:
            raise LocalProtocolError(f"room {self.bootstrap_room}: init() called twice")
        self._rx = self.kv_mgr.engine.receiver(self.bootstrap_room, _endpoint(self.bootstrap_addr))

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
    ) -> None:
        """This rank's pages for the request's tokens after ``decode_prefix_len``; after WaitingForInput.

        Does nothing once the room has failed (poll() reports it); bad input still raises.
        """
        if state_indices:
            raise ConfigError(f"state_indices={state_indices!r}: hybrid-model state is not supported")
        if destination != KVTransferDestination.DEVICE:
            raise ConfigError(f"destination={destination!r}: only device destinations are supported")
        if self._rx is None:
            raise LocalProtocolError(f"room {self.bootstrap_room}: send_metadata() before init()")
        if self.kv_mgr.aux is not None and aux_index is not None:
            self.kv_mgr.aux._check(aux_index)
        pages = np.asarray(kv_indices.cpu() if hasattr(kv_indices, "cpu") else kv_indices)
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

    def poll(self) -> RoomStatus:
        if self._rx is None:
            return RoomStatus.BOOTSTRAPPING
        status = self._rx.poll()
        if status is RoomStatus.SUCCESS and not self._unpacked:
            if self._aux_index is not None and self.kv_mgr.aux is not None:
                self.kv_mgr.aux.unpack(self._aux_index)
            self._unpacked = True
        return status

    def failure_exception(self) -> None:
        """Raise the room's typed TransferFailed (see ``_raise_failure`` for a room failed elsewhere)."""
        _raise_failure(self._rx, self.bootstrap_room)

    def abort(self) -> None:
        if self._rx is not None:
            self._rx.abort("aborted by the SGLang scheduler")


class KVBootstrapServer(BaseKVBootstrapServer):
    """The bootstrap registry at ``tcp://host:port``, on a thread of its own beside the HTTP server.

    Prefill ranks register their control endpoints here; decode ranks ask it for the prefill
    instance's topology. ``close()`` stops it and joins its thread.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
        portal = self._portal_cm.__enter__()
        try:
            curve = Curve.from_config(EngineConfig.from_env(role="prefill"))
            self._bootstrap = Bootstrap(host, port, curve=curve)
            self._running, _ = portal.start_task(self._bootstrap.run)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._closed = False

    @property
    def endpoint(self) -> str:
        return f"tcp://{_connect_host(self.host)}:{self.port}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._running.cancel()
        self._portal_cm.__exit__(None, None, None)
