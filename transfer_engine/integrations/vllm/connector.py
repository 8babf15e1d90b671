"""A vLLM KV connector (``KVConnectorBase_V1``) that moves each request's KV with this engine.

Load it with::

    KVTransferConfig(
        kv_connector="TransferEngineConnector",
        kv_connector_module_path="transfer_engine.integrations.vllm.connector",
        kv_role="kv_producer",  # the prefill; "kv_consumer" on the decode
        kv_connector_extra_config={"bootstrap_port": 8998},  # prefill: where its bootstrap listens
    )

Configuration (docs/vllm.md): the engine's settings are :class:`~transfer_engine.EngineConfig`
fields, taken from, lowest first: the connector's defaults (:data:`CONNECTOR_DEFAULTS`), ``TE_*``
variables, then ``kv_connector_extra_config``; vLLM sets ``role``, ``tp_size`` and ``tp_rank``. The
one connector-only key is ``engine_cpus`` (default every CPU: a list of CPU ids the engine thread
and the threads it starts may run on; vLLM's CPU worker pins its main thread to one core before
registering its KV caches, and a thread left with that pin waits behind the main threads of every
instance spinning there). Any other key is refused at start-up, naming it. Data-parallel engine
``r`` binds ``bootstrap_port + r``; ``introspect_port`` and ``metrics_port``, when set, are offset by
the engine's rank (``r * tp_size + tp_rank``). The defaults suit a loaded CPU box: the engine's
thread shares the GIL with vLLM's worker, which can hold it for seconds.

Push model, as the engine is: the decode allocates blocks and the prefill WRITEs into them. Two
router protocols work, with ``kv_transfer_params`` in the request bodies:

- sequential (vLLM's standard): the prefill gets ``{"do_remote_decode": true}`` and
  ``max_tokens=1``; the ``kv_transfer_params`` of its response (``request_finished``'s return:
  ``do_remote_prefill``, ``transfer_id``, ``bootstrap``, ``tp_size``, ``block_size``) go with the
  original request to the decode. A prefill request without ``transfer_id`` gets one minted from
  its request id, and holds its blocks until the decode asked for them (or their lease ended).
- concurrent (``transfer_engine.integrations.vllm.proxy``): both at once, the prefill with
  ``{"do_remote_decode": true, "transfer_id": ID}``, the decode with ``{"do_remote_prefill": true,
  "transfer_id": ID, "bootstrap": "tcp://HOST:PORT"}``.

``ID`` is any string unique among live transfers; both sides turn it into the room (:func:`room_of`,
a 63-bit hash). A request fanned out by vLLM for ``n > 1`` (child ``i``) moves its KV under ``ID#i``,
so the prefill leg must carry the same ``n`` as the decode's. The prefill also WRITEs a 16-byte
digest of the full ID with the KV (the engine's aux item) and the decode checks it, so a hash
collision between two IDs can never hand one request another's KV: the decode reports its blocks
as failed and vLLM recomputes them (or fails the request, per ``kv_load_failure_policy``).

``kv_transfer_params`` come from the client: :func:`plan_of` reads them without raising. Keys
that are not this connector's, values of the wrong type, a ``block_size`` unlike this instance's or
a transfer ID already live here log a WARNING naming the request and the key, and the request is
computed here as if it carried none. A bootstrap nobody answers fails the load: vLLM's
``kv_load_failure_policy`` decides.

Prefix caching (vLLM's default) on the decode: a request asks the prefill only for the blocks it
has no cached KV for (``decode_prefix_len``, the locally cached tokens, a whole number of blocks),
and the prefill WRITEs only those. A request whose prompt is all cached asks for nothing and cancels
the prefill's room at once, which frees the prefill's blocks.

Blocks: the prefill holds a finished request's blocks (``request_finished`` returns True) until its
room ended on every TP rank, i.e. until no WRITE from them can still be in flight (success, failure
or the end of the room's lease); the decode's blocks are reported loaded only once the room
succeeded, and a decode request aborted while waiting holds its blocks until its room was aborted
(no WRITE can land any more). A prefill request aborted before it finished aborts its room, which
fails the decode's room at once. A decode request that ends before its blocks were allocated
(aborted in the queue) opens its room without pages and aborts it, so the prefill learns it will
never ask: a prefill room whose decode aborted first (even before the prefill opened it) fails at
once and frees the blocks. A decode's room opens when vLLM allocates its blocks; from the moment
vLLM queues the request (``on_new_request``) each decode rank announces the room to the prefill
(``TransferEngine.announce``), whose heartbeats-renewed lease then holds a prefill's finished KV
for it however long it queues (docs/vllm.md, "Timeouts and leases"). The scheduler side's decisions are
:class:`TransferBook`, plain Python; the worker side translates vLLM's calls for the vLLM-free
:class:`~transfer_engine.integrations.vllm.core.ConnectorCore` (one per TP rank).

Layer-wise sending: in the step that computes a request's last prompt tokens, the prefill opens its
room before the forward (``bind_connector_metadata``) with the request's blocks as one layer-wise
chunk (``Sender.begin_chunk``, once the decode's request says which blocks it lacks), and each
``save_kv_layer`` hands the layer just written to it (``layers_ready``): layers go out in groups of
``layers_per_write`` (default 4) while the forward computes the next ones, instead of all after the
request finished. A prompt computed over several steps (chunked prefill) sends all its blocks'
layers in its last step (the earlier steps' KV is written by then).

Metrics: :class:`TransferStats` (transfers, bytes, failures by kind, transfer seconds) through
vLLM's ``KVConnectorStats`` (its periodic "KV Transfer metrics" log line) and Prometheus counters
on vLLM's ``/metrics`` (``vllm:te_kv_*``, :class:`TransferPromMetrics`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
)

from transfer_engine.errors import ConfigError

from .book import Transfer, TransferBook, TransferMetadata
from .core import ConnectorCore, digest_of
from .params import Plan, plan_of, room_of
from .settings import CONNECTOR_DEFAULTS, default_max_rooms, engine_config, engine_cpus
from .stats import TransferPromMetrics, TransferStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from transfer_engine import EngineConfig
__all__ = [
    "CONNECTOR_DEFAULTS",
    "Plan",
    "Transfer",
    "TransferBook",
    "TransferEngineConnector",
    "TransferMetadata",
    "TransferPromMetrics",
    "TransferStats",
    "digest_of",
    "engine_config",
    "engine_cpus",
    "plan_of",
    "room_of",
]
"""The connector's own names, and those of its parts (:mod:`.settings`, :mod:`.params`, :mod:`.book`,
:mod:`.stats`) that vLLM's users and this connector's docs name from here."""

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.02
"""How long a worker waits in ``get_finished`` on a step that runs no model, for a transfer to end
(it returns as soon as one does). vLLM steps without pause while a connector has transfers out
(``has_pending_push_work``), and each empty step is broadcast to every TP worker: on a 2-core box
those steps starved the engine's threads (docs/DECISIONS.md, "Empty steps wait for transfers")."""


def _log_through_vllm() -> None:
    """Give this package's log records vLLM's handlers (vLLM configures only its own loggers): the
    connector's INFO lines (the dump port) and the engine's warnings appear in vLLM's log."""
    ours = logging.getLogger("transfer_engine")
    if ours.handlers:
        return
    for handler in logging.getLogger("vllm").handlers:
        ours.addHandler(handler)
    if ours.handlers:
        ours.propagate = False
        ours.setLevel(logging.WARNING)
        logging.getLogger(__package__).setLevel(logging.INFO)


class TransferEngineConnector(KVConnectorBase_V1):
    """See the module docstring. One instance per role: the scheduler's, and one per TP worker."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        tc = self._kv_transfer_config
        if tc.kv_role not in ("kv_producer", "kv_consumer"):
            raise ConfigError(f"kv_role={tc.kv_role!r}: use kv_producer (prefill) or kv_consumer (decode)")
        self.is_prefill = tc.kv_role == "kv_producer"
        extra = dict(tc.kv_connector_extra_config or {})
        self.engine_cpus = engine_cpus(extra.get("engine_cpus"))
        parallel = vllm_config.parallel_config
        self._extra = extra
        self._dp_rank = parallel.data_parallel_rank
        self._max_rooms = default_max_rooms(vllm_config.scheduler_config.max_num_seqs)
        config = engine_config(
            extra, os.environ, is_prefill=self.is_prefill, tp_size=parallel.tensor_parallel_size, tp_rank=0,
            dp_rank=self._dp_rank, max_rooms=self._max_rooms,
        )  # fmt: skip
        self.block_size = vllm_config.cache_config.block_size
        self._book = TransferBook(
            is_prefill=self.is_prefill,
            block_size=self.block_size,
            bootstrap=config.bootstrap_endpoint,
            tp_size=parallel.tensor_parallel_size,
        )
        # worker side
        self._core: ConnectorCore | None = None
        self._idle_step = False
        if role == KVConnectorRole.WORKER:
            self._vllm_config = vllm_config

    # ==== scheduler side ============================================================================

    def on_new_request(self, request: Request) -> None:
        """Decode: announce the request's room to its prefill while it waits in vLLM's queue."""
        self._book.added(request)

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
        """Prefill: hold the blocks of a finished request until its KV went out (or failed), and
        return the params its decode needs; an aborted one aborts its room. Decode: a request
        aborted while its KV was coming holds its blocks until the room is aborted; one that ended
        before its room opened cancels the room on the prefill."""
        return self._book.finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping while transfers are out: their ends arrive through ``get_finished``."""
        return self._book.has_work()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TransferStats(data=data) if data is not None else TransferStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetric]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return TransferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ==== worker side ===============================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Start this rank's :class:`~.core.ConnectorCore` over vLLM's KV caches, as the attention
        backend laid them out (the resolved ``KVCacheLayout``; MLA: one latent per layer)."""
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        config = engine_config(
            self._extra, os.environ, is_prefill=self.is_prefill,
            tp_size=get_tensor_model_parallel_world_size(), tp_rank=get_tensor_model_parallel_rank(),
            dp_rank=self._dp_rank, max_rooms=self._max_rooms,
        )  # fmt: skip
        model = self._vllm_config.model_config
        self._core = ConnectorCore(
            config,
            kv_caches,
            layout=self._vllm_config.cache_config.get_resolved_kv_cache_layout().name,
            block_size=self.block_size,
            head_size=None if model.use_mla else model.get_head_size(),
            num_kv_heads=model.get_total_num_kv_heads(),
            cpus=self.engine_cpus,
            transport=self.make_transport(config),
        )
        self._core.start()

    def make_transport(self, config: EngineConfig) -> Any:
        """This rank's engine transport: None, the engine makes its own NIXL agent. A test's subclass
        returns a fault-injecting wrapper around a real one named ``config.agent_name``."""
        return None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward: open the layer-wise rooms of the requests it completes."""
        super().bind_connector_metadata(connector_metadata)
        if self._core is None or not isinstance(connector_metadata, TransferMetadata):
            return
        for t in connector_metadata.layerwise:
            self._core.begin_layers(t.req_id, t.transfer_id, t.block_ids)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Hand this step's new transfers and aborts to the core; never waits for them."""
        if self._core is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TransferMetadata)
        self._idle_step = meta.idle
        for t in meta.announce:
            self._core.announce(t.req_id, t.transfer_id, t.bootstrap)
        for t in meta.abort:
            self._core.abort(t.req_id, t.transfer_id)
        for t in meta.cancel:
            self._core.cancel(t.req_id, t.transfer_id, t.bootstrap)
        for t in meta.start:
            if self.is_prefill:
                self._core.send(t.req_id, t.transfer_id, t.block_ids)
            else:
                self._core.receive(t.req_id, t.transfer_id, t.block_ids, t.bootstrap, t.prefix_len)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request runs only after its whole KV landed."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """The forward queued ``layer_name``'s cache writes: this step's layer-wise rooms may send it
        once they ran (GPU: an event on the current stream; CPU: written when this is called). The
        WRITE runs while the forward goes on."""
        if self._core is not None:
            self._core.layer_written(self._core.layer_index(layer_name))

    def wait_for_save(self) -> None:
        """The forward is over: hand any layer not reported yet to the layer-wise rooms. Sends are
        asynchronous and hold their blocks until ``get_finished`` reports them."""
        if self._core is not None:
            self._core.step_written()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose prefill room ended, requests whose decode room ended) since the last call."""
        if self._core is None:
            return None, None
        if self._idle_step:  # see IDLE_WAIT_S
            self._idle_step = False
            self._core.wait_for_news(IDLE_WAIT_S)
        sent, received = self._core.take_finished()
        return sent or None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of decode rooms that failed (or whose digest did not match): vLLM recomputes them
        or fails the request, per its ``kv_load_failure_policy``."""
        return self._core.take_load_errors() if self._core is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This worker's :class:`TransferStats` since the last call (None when nothing happened)."""
        if self._core is None:
            return None
        stats = TransferStats(data=self._core.take_stats())
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        if self._core is not None:
            self._core.close()
            self._core = None
