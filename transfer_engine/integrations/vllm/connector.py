"""A vLLM KV connector (``KVConnectorBase_V1``) that moves each request's KV with this engine.

Load it with::

    KVTransferConfig(
        kv_connector="TransferEngineConnector",
        kv_connector_module_path="transfer_engine.integrations.vllm.connector",
        kv_role="kv_producer",  # the prefill; "kv_consumer" on the decode
        kv_connector_extra_config={"bootstrap_port": 8998},  # prefill: where its bootstrap listens
    )

``kv_connector_extra_config`` keys (all optional): ``bootstrap_port`` (prefill, default 8998),
``host`` (where the engine binds, default 127.0.0.1), ``bootstrap_timeout`` (seconds a decode's
request may wait for the prefill to reach it, default 120: it covers the prefill's queue), and
``introspect_port`` (TP rank ``r`` serves ``transfer-engine dump`` on this port + ``r``; 0 picks one)
and ``heartbeat_interval`` (default 5 s, a peer is dead after two silent intervals: the engine's
thread shares the GIL with vLLM's worker, which can hold it for seconds on a loaded CPU box), and
``connect_timeout`` (default 30 s, for the decode's first handshake with a prefill, for the same reason),
``layers_per_write`` (prefill, default 4: the layers of a request that go out in one WRITE).
``engine_cpus`` (default every CPU: a list of CPU ids the engine thread and the threads it starts may
run on; vLLM's CPU worker pins its main thread to one core before registering its KV caches, and a
thread left with that pin waits behind the main threads of every instance spinning there).

Push model, as the engine is: the decode allocates blocks and the prefill WRITEs into them. A
router (``transfer_engine.integrations.vllm.proxy``) gives both instances the same request at once,
with ``kv_transfer_params``:

- prefill: ``{"do_remote_decode": true, "transfer_id": ID}`` and ``max_tokens=1``;
- decode: ``{"do_remote_prefill": true, "transfer_id": ID, "bootstrap": "tcp://HOST:PORT"}``.

``ID`` is any string unique among live transfers; both sides turn it into the room (:func:`room_of`,
a 63-bit hash). The prefill also WRITEs a 16-byte digest of the full ID with the KV (the engine's aux
item) and the decode checks it, so a hash collision between two IDs can never hand one request
another's KV: the decode reports its blocks as failed and vLLM recomputes them.

Blocks: the prefill holds a finished request's blocks (``request_finished`` returns True) until its
room ended on every TP rank, i.e. until no WRITE from them can still be in flight; the decode's
blocks are reported loaded only once the room succeeded, and a decode request aborted while waiting
holds its blocks until its room was aborted (no WRITE can land any more). A prefill request aborted
before it finished aborts its room, which fails the decode's room at once. A decode request that
ends before its blocks were allocated (aborted in the queue) opens its room without pages and
aborts it, so the prefill learns it will never ask: a prefill room whose decode aborted first (even
before the prefill opened it) fails at once and frees the blocks, instead of holding them until
``bootstrap_timeout``. The scheduler side's decisions are :class:`TransferBook`, plain Python.

The decode must run without prefix caching (``enable_prefix_caching=False``): the transfer fills
the request's blocks from token 0, and cached blocks are shared with other requests. Constructing
the decode side with it on raises :class:`~transfer_engine.errors.ConfigError`.

Layer-wise sending: in the step that computes a request's last prompt tokens, the prefill opens its
room before the forward (``bind_connector_metadata``) with the request's blocks as one layer-wise
chunk (``Sender.begin_chunk``), and each ``save_kv_layer`` hands the layer just written to it
(``layers_ready``): layers go out in groups of ``layers_per_write`` (default 4) while the forward
computes the next ones, instead of all after the request finished. A prompt computed over several
steps (chunked prefill) sends all its blocks' layers in its last step (the earlier steps' KV is
written by then).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from transfer_engine.errors import ConfigError
from transfer_engine.protocol.room_ids import room_id

from ._runner import EngineThread

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["TransferBook", "TransferEngineConnector", "digest_of", "engine_cpus", "room_of"]

log = logging.getLogger(__name__)

DIGEST_BYTES = 16

IDLE_WAIT_S = 0.02
"""How long a worker waits in ``get_finished`` on a step that runs no model, for a transfer to end
(it returns as soon as one does). vLLM steps without pause while a connector has transfers out
(``has_pending_push_work``), and each empty step is broadcast to every TP worker: on a 2-core box
those steps starved the engine threads that end the transfers (docs/DECISIONS.md, issue 20)."""


def room_of(transfer_id: str) -> int:
    """The engine room of a transfer: :func:`transfer_engine.protocol.room_ids.room_id` of its ID (the same on both sides)."""
    return room_id(transfer_id)


def engine_cpus(value: object) -> frozenset[int]:
    """The CPUs the engine thread may run on: ``kv_connector_extra_config["engine_cpus"]`` (a list of
    CPU ids), or every CPU of the machine when unset (the kernel keeps only those the process's
    cpuset allows). Raises ConfigError naming a value that is not a non-empty list of CPU ids."""
    if value is None:
        return frozenset(range(os.cpu_count() or 1))
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value)
    ):
        raise ConfigError(f"engine_cpus={value!r}: give a non-empty list of CPU ids, e.g. [2, 3]")
    return frozenset(value)


def digest_of(transfer_id: str) -> bytes:
    """The 16 bytes the prefill WRITEs beside the KV and the decode checks: the full ID's digest."""
    return hashlib.blake2b(transfer_id.encode(), digest_size=DIGEST_BYTES, person=b"te-vllm").digest()


@dataclass(frozen=True)
class Transfer:
    """One request's transfer as the scheduler hands it to the workers."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    bootstrap: str = ""
    """Decode only: the prefill instance's bootstrap endpoint."""


@dataclass
class TransferMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: transfers to start, requests to abort, and (decode)
    requests that ended before their room opened, whose prefill must hear it (``cancel``)."""

    start: list[Transfer] = field(default_factory=list)
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


class TransferBook:
    """The scheduler side's state and decisions, plain Python (no vLLM process needed to test it)."""

    def __init__(self, *, is_prefill: bool, block_size: int) -> None:
        self.is_prefill = is_prefill
        self.block_size = block_size
        self.pending = TransferMetadata()
        self.in_flight: dict[str, Transfer] = {}
        """Requests whose transfer the workers have not reported ended yet."""
        self.asked: set[str] = set()
        """Decode: requests whose blocks were already given to a transfer (never ask twice)."""
        self.prefilling: dict[str, _Prefilling] = {}
        """Prefill: requests to send whose last prompt tokens are not scheduled yet."""
        self.layerwise: set[str] = set()
        """Prefill: requests whose layer-wise send started and that have not finished."""
        self.sent_early: set[str] = set()
        """Prefill: requests of ``layerwise`` whose room ended before they finished."""

    def _num_blocks(self, request: RequestView) -> int:
        return -(-len(request.prompt_token_ids or ()) // self.block_size)

    def matched(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        """Decode: the whole prompt comes from the prefill, loaded asynchronously. Prefill: nothing."""
        params = request.kv_transfer_params or {}
        if self.is_prefill or not params.get("do_remote_prefill") or request.request_id in self.asked:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def allocated(self, request: RequestView, block_ids: list[int], num_external_tokens: int) -> None:
        """Decode: the blocks for the prompt exist; the workers open the room next step. Prefill:
        a request to send is scheduled for the first time (see :meth:`scheduled`)."""
        if self.is_prefill:
            params = request.kv_transfer_params or {}
            transfer_id = params.get("transfer_id")
            if params.get("do_remote_decode") and isinstance(transfer_id, str):
                self.prefilling[request.request_id] = _Prefilling(
                    transfer_id, len(request.prompt_token_ids or ())
                )
            return
        if num_external_tokens == 0:
            return
        params = request.kv_transfer_params or {}
        transfer_id, bootstrap = params.get("transfer_id"), params.get("bootstrap")
        if not isinstance(transfer_id, str) or not isinstance(bootstrap, str):
            raise ConfigError(
                f"request {request.request_id}: kv_transfer_params {params!r} need string transfer_id and bootstrap"
            )
        transfer = Transfer(
            request.request_id, transfer_id, tuple(block_ids[: self._num_blocks(request)]), bootstrap
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

    def finished(self, request: RequestView, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: (hold the blocks?, kv_transfer_params for the response)."""
        req_id = request.request_id
        asked = req_id in self.asked
        self.asked.discard(req_id)
        params = request.kv_transfer_params or {}
        transfer_id = params.get("transfer_id")
        if self.is_prefill:
            self.prefilling.pop(req_id, None)
            if req_id in self.layerwise:  # its room opened: hold the blocks until it ended
                self.layerwise.discard(req_id)
                done = req_id in self.sent_early
                self.sent_early.discard(req_id)
                if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
                    assert isinstance(transfer_id, str)
                    return not done, {"transfer_id": transfer_id, "room": room_of(transfer_id)}
                if not done:
                    self.pending.abort.append(self.in_flight[req_id])
                return not done, None
            if not params.get("do_remote_decode") or not isinstance(transfer_id, str):
                return False, None
            transfer = Transfer(req_id, transfer_id, tuple(block_ids[: self._num_blocks(request)]))
            if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
                self.in_flight[req_id] = transfer
                self.pending.start.append(transfer)
                return True, {"transfer_id": transfer_id, "room": room_of(transfer_id)}
            self.pending.abort.append(transfer)  # the workers fail the room; the blocks free now
            return False, None
        receiving = self.in_flight.get(req_id)
        if receiving is not None:  # its room may still take WRITEs: hold the blocks until it ended
            self.pending.abort.append(receiving)
            return True, None
        bootstrap = params.get("bootstrap")
        if (
            not asked
            and params.get("do_remote_prefill")
            and isinstance(transfer_id, str)
            and isinstance(bootstrap, str)
        ):  # ended before its blocks were allocated: its room never opened here, tell the prefill
            self.pending.cancel.append(Transfer(req_id, transfer_id, (), bootstrap))
        return False, None

    def take_meta(self) -> TransferMetadata:
        meta, self.pending = self.pending, TransferMetadata()
        return meta

    def has_work(self) -> bool:
        p = self.pending
        return bool(self.in_flight or p.start or p.layerwise or p.abort or p.cancel)


@dataclass
class _Prefilling:
    transfer_id: str
    num_tokens: int
    block_ids: list[int] = field(default_factory=list)


class TransferEngineConnector(KVConnectorBase_V1):
    """See the module docstring. One instance per role: the scheduler's, and one per TP worker."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        tc = self._kv_transfer_config
        if tc.kv_role not in ("kv_producer", "kv_consumer"):
            raise ConfigError(f"kv_role={tc.kv_role!r}: use kv_producer (prefill) or kv_consumer (decode)")
        self.is_prefill = tc.kv_role == "kv_producer"
        extra = dict(tc.kv_connector_extra_config or {})
        self.bootstrap_port = int(extra.get("bootstrap_port", 8998))
        self.host = str(extra.get("host", "127.0.0.1"))
        self.bootstrap_timeout = float(extra.get("bootstrap_timeout", 120.0))
        self.introspect_port = int(extra.get("introspect_port", 0))
        self.heartbeat_interval = float(extra.get("heartbeat_interval", 5.0))
        self.connect_timeout = float(extra.get("connect_timeout", 30.0))
        self.layers_per_write = int(extra.get("layers_per_write", 4))
        self.engine_cpus = engine_cpus(extra.get("engine_cpus"))
        self.block_size = vllm_config.cache_config.block_size
        if not self.is_prefill and vllm_config.cache_config.enable_prefix_caching:
            raise ConfigError(
                "enable_prefix_caching=True on the decode (kv_consumer): transfers fill a request's blocks "
                "from token 0, so run the decode with --no-enable-prefix-caching"
            )
        self._book = TransferBook(is_prefill=self.is_prefill, block_size=self.block_size)
        # worker side
        self._runner: EngineThread | None = None
        self._idle_step = False
        self._layer_index: dict[str, int] = {}
        if role == KVConnectorRole.WORKER:
            self._vllm_config = vllm_config

    # ==== scheduler side ============================================================================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._book.matched(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._book.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._book.scheduled(scheduler_output)
        meta = self._book.take_meta()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.finished_sending:
            connector_output.finished_sending = self._book.sent(connector_output.finished_sending)
        self._book.ended(connector_output.finished_recving or ())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: hold the blocks of a finished request until its KV went out (or failed); an
        aborted one aborts its room. Decode: a request aborted while its KV was coming holds its
        blocks until the room is aborted; one that ended before its room opened cancels the room
        on the prefill."""
        return self._book.finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping while transfers are out: their ends arrive through ``get_finished``."""
        return self._book.has_work()

    # ==== worker side ===============================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Start this rank's engine over vLLM's KV (CPU layout: per layer ``[num_blocks, heads_local,
        block_size, 2 * head_size]``)."""
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._runner = EngineThread(
            role="prefill" if self.is_prefill else "decode",
            layers=list(kv_caches.values()),
            head_dim=self._vllm_config.model_config.get_head_size(),
            tp_size=get_tensor_model_parallel_world_size(),
            tp_rank=get_tensor_model_parallel_rank(),
            host=self.host,
            bootstrap_port=self.bootstrap_port,
            max_rooms=2 * self._vllm_config.scheduler_config.max_num_seqs,
            bootstrap_timeout=self.bootstrap_timeout,
            introspect_port=self.introspect_port,
            heartbeat_interval=self.heartbeat_interval,
            connect_timeout=self.connect_timeout,
            layers_per_write=self.layers_per_write,
            cpus=self.engine_cpus,
        )
        self._runner.start()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward: open the layer-wise rooms of the requests it completes."""
        super().bind_connector_metadata(connector_metadata)
        if self._runner is None or not isinstance(connector_metadata, TransferMetadata):
            return
        for t in connector_metadata.layerwise:
            room, digest = room_of(t.transfer_id), digest_of(t.transfer_id)
            self._runner.send_layerwise(t.req_id, room, t.transfer_id, list(t.block_ids), digest)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Hand this step's new transfers and aborts to the engine thread; never waits for them."""
        if self._runner is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TransferMetadata)
        self._idle_step = meta.idle
        for t in meta.abort:
            self._runner.abort(t.req_id, room_of(t.transfer_id))
        for t in meta.cancel:
            self._runner.cancel(t.req_id, room_of(t.transfer_id), t.bootstrap)
        for t in meta.start:
            room, digest = room_of(t.transfer_id), digest_of(t.transfer_id)
            if self.is_prefill:
                self._runner.send(t.req_id, room, t.transfer_id, list(t.block_ids), digest)
            else:
                self._runner.receive(t.req_id, room, t.transfer_id, list(t.block_ids), t.bootstrap, digest)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request runs only after its whole KV landed."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """The forward wrote ``layer_name``: this step's layer-wise rooms may send it (CPU: the
        layer is written when this is called; the WRITE runs while the forward goes on)."""
        if self._runner is not None:
            self._runner.layer_written(self._layer_index[layer_name])

    def wait_for_save(self) -> None:
        """The forward is over: hand any layer not reported yet to the layer-wise rooms. Sends are
        asynchronous and hold their blocks until ``get_finished`` reports them."""
        if self._runner is not None:
            self._runner.step_written()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose prefill room ended, requests whose decode room ended) since the last call."""
        if self._runner is None:
            return None, None
        if self._idle_step:  # see IDLE_WAIT_S
            self._idle_step = False
            self._runner.wait_for_news(IDLE_WAIT_S)
        sent, received = self._runner.take_finished()
        return sent or None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of decode rooms that failed (or whose digest did not match): vLLM recomputes them."""
        return self._runner.take_load_errors() if self._runner is not None else set()

    def shutdown(self) -> None:
        if self._runner is not None:
            self._runner.stop()
            self._runner = None
