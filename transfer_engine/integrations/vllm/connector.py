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
  its request id, and holds its blocks until the decode asked for them (or ``bootstrap_timeout``).
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
or the room's ``bootstrap_timeout``); the decode's blocks are reported loaded only once the room
succeeded, and a decode request aborted while waiting holds its blocks until its room was aborted
(no WRITE can land any more). A prefill request aborted before it finished aborts its room, which
fails the decode's room at once. A decode request that ends before its blocks were allocated
(aborted in the queue) opens its room without pages and aborts it, so the prefill learns it will
never ask: a prefill room whose decode aborted first (even before the prefill opened it) fails at
once and frees the blocks. A decode's room opens when vLLM allocates its blocks, so its time in
vLLM's queue before that is not counted against it. The scheduler side's decisions are
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
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

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
from vllm.v1.request import RequestStatus

from transfer_engine import EngineConfig, room_id
from transfer_engine.errors import ConfigError

from .core import ConnectorCore, digest_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "CONNECTOR_DEFAULTS",
    "Plan",
    "TransferBook",
    "TransferEngineConnector",
    "TransferStats",
    "digest_of",
    "engine_config",
    "engine_cpus",
    "plan_of",
    "room_of",
]

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.02
"""How long a worker waits in ``get_finished`` on a step that runs no model, for a transfer to end
(it returns as soon as one does). vLLM steps without pause while a connector has transfers out
(``has_pending_push_work``), and each empty step is broadcast to every TP worker: on a 2-core box
those steps starved the engine's threads (docs/DECISIONS.md, "Empty steps wait for transfers")."""

CONNECTOR_DEFAULTS: dict[str, Any] = {
    "heartbeat_interval": 5.0,
    "connect_timeout": 30.0,
    "bootstrap_timeout": 120.0,
    "layers_per_write": 4,
}
"""Engine settings the connector picks unless ``TE_*`` variables or ``kv_connector_extra_config``
say otherwise: a peer is dead after two silent heartbeat intervals, and the first handshake may
take long, as vLLM's worker can hold the GIL for seconds on a loaded CPU box; a room may wait
``bootstrap_timeout`` for its peer (the prefill's queue, or the decode's request)."""

CONNECTOR_ONLY = frozenset({"engine_cpus"})
SET_BY_VLLM = frozenset({"role", "tp_size", "tp_rank"})

PARAM_KEYS = frozenset(
    {"do_remote_prefill", "do_remote_decode", "transfer_id", "bootstrap", "tp_size", "block_size",
     "remote_prefill_cached_tokens"}
)  # fmt: skip
"""The ``kv_transfer_params`` keys this connector reads or returns, and the one vLLM's scheduler adds
to a prefill's answer (``remote_prefill_cached_tokens``, for the decode's usage report)."""

MAX_ID_CHARS = 256
_BOOTSTRAP = re.compile(r"tcp://[A-Za-z0-9.\-\[\]:]+:\d{1,5}")
_CHILD = re.compile(r"(\d+)_(.+)")
"""vLLM's id of child ``i`` of a request fanned out for ``n > 1``: ``f"{i}_{parent_id}"``
(``ParentRequest.get_child_info``); the parent ids of vLLM's servers never start with digits and
``_`` (``cmpl-...``, ``chatcmpl-...``)."""


def room_of(transfer_id: str) -> int:
    """The engine room of a transfer: :func:`transfer_engine.room_id` of its ID (the same on both sides)."""
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


def engine_config(
    extra: Mapping[str, Any],
    environ: Mapping[str, str],
    *,
    is_prefill: bool,
    tp_size: int,
    tp_rank: int,
    dp_rank: int = 0,
    max_rooms: int = 4096,
) -> EngineConfig:
    """One rank's engine settings: :data:`CONNECTOR_DEFAULTS` (and ``max_rooms``), overridden by
    ``TE_<FIELD>`` variables in ``environ``, overridden by ``extra`` (``kv_connector_extra_config``);
    ``bootstrap_host`` defaults to ``host``. Data-parallel rank ``dp_rank`` binds ``bootstrap_port
    + dp_rank``; a non-zero ``introspect_port``/``metrics_port`` is offset by ``dp_rank * tp_size +
    tp_rank``. ConfigError names a key that is neither an engine setting nor ``engine_cpus``, one
    that vLLM sets, or a bad value."""
    fields = EngineConfig.__struct_fields__
    for key in extra:
        if key in SET_BY_VLLM:
            raise ConfigError(
                f"kv_connector_extra_config key {key!r}: vLLM sets it (kv_role, TP size and rank)"
            )
        if key not in fields and key not in CONNECTOR_ONLY:
            raise ConfigError(
                f"kv_connector_extra_config key {key!r} is not an engine setting (EngineConfig)"
            )
    from_env = {
        name: environ["TE_" + name.upper()]
        for name in fields
        if "TE_" + name.upper() in environ and name not in SET_BY_VLLM
    }
    ours = {k: v for k, v in extra.items() if k in fields}
    raw: dict[str, Any] = {**CONNECTOR_DEFAULTS, "max_rooms": max_rooms, **from_env, **ours}
    fixed = {"role": "prefill" if is_prefill else "decode", "tp_size": tp_size, "tp_rank": tp_rank}
    base = EngineConfig.from_env({}, **raw, **fixed)
    rank = dp_rank * tp_size + tp_rank
    placed: dict[str, Any] = {"bootstrap_port": base.bootstrap_port + dp_rank}
    if "bootstrap_host" not in from_env and "bootstrap_host" not in ours:
        placed["bootstrap_host"] = base.host
    if base.introspect_port:
        placed["introspect_port"] = base.introspect_port + rank
    if base.metrics_port:
        placed["metrics_port"] = base.metrics_port + rank
    return EngineConfig.from_env({}, **{**raw, **placed, **fixed})


@dataclass(frozen=True)
class Plan:
    """What a request's ``kv_transfer_params`` ask of this side."""

    base_id: str
    """The transfer ID the params name (or the prefill minted), as the decode must be told it."""
    transfer_id: str
    """This request's own: ``base_id``, or ``base_id#i`` for vLLM's child ``i`` of an ``n > 1`` request."""
    bootstrap: str = ""
    """Decode only: the prefill instance's bootstrap endpoint."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def plan_of(
    request_id: str, params: object, *, is_prefill: bool, block_size: int
) -> tuple[Plan | None, list[str]]:
    """Read a request's ``kv_transfer_params`` (whatever the client sent; never raises): the plan,
    or None when this side has nothing to move for it, and the problems found, each naming its key.

    Prefill: ``do_remote_decode: true``, with a string ``transfer_id`` or none (one is minted from
    the request id, without vLLM's child prefix, so all children of one request share it). Decode:
    ``do_remote_prefill: true`` with a string ``transfer_id``, a ``tcp://HOST:PORT`` ``bootstrap``,
    and, when given, this instance's ``block_size`` and a positive ``tp_size``. A problem with any
    of these means None; a key this connector does not know is a problem, and is ignored."""
    if params is None:
        return None, []
    if not isinstance(params, Mapping):
        return None, [f"kv_transfer_params {params!r} is not an object"]
    problems = [f"key {k!r} is not this connector's, ignored" for k in params if k not in PARAM_KEYS]
    mine, theirs = (
        ("do_remote_decode", "do_remote_prefill") if is_prefill else ("do_remote_prefill", "do_remote_decode")
    )
    if params.get(theirs) is not None and params.get(theirs) is not False:
        problems.append(f"key {theirs!r} is for a {'decode' if is_prefill else 'prefill'} instance, ignored")
    wanted = params.get(mine)
    if wanted is None or wanted is False:
        return None, problems
    if wanted is not True:
        return None, [*problems, f"key {mine!r}={wanted!r} is not a boolean"]
    child = _CHILD.fullmatch(request_id)
    base = params.get("transfer_id")
    if base is None and is_prefill:
        base = child.group(2) if child else request_id
    if not isinstance(base, str) or not base or len(base) > MAX_ID_CHARS:
        return None, [
            *problems,
            f"key 'transfer_id'={base!r} is not a string of 1 to {MAX_ID_CHARS} characters",
        ]
    transfer_id = f"{base}#{child.group(1)}" if child else base
    if is_prefill:
        return Plan(base, transfer_id), problems
    bootstrap = params.get("bootstrap")
    if not isinstance(bootstrap, str) or not _BOOTSTRAP.fullmatch(bootstrap):
        return None, [*problems, f"key 'bootstrap'={bootstrap!r} is not tcp://HOST:PORT"]
    theirs_size = params.get("block_size", block_size)
    if theirs_size != block_size or not _is_int(theirs_size):
        return None, [*problems, f"key 'block_size'={theirs_size!r} is not this instance's {block_size}"]
    tp_size = params.get("tp_size", 1)
    if not _is_int(tp_size) or tp_size < 1:
        return None, [*problems, f"key 'tp_size'={tp_size!r} is not a positive integer"]
    return Plan(base, transfer_id, bootstrap), problems


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


class TransferStats(KVConnectorStats):
    """What the workers' engines did since the last report, as vLLM gathers it from every worker
    (``get_kv_connector_stats``, then :meth:`aggregate`) for its log line and ``/metrics``.

    ``data`` (plain, serializable): ``transfers`` (rooms that succeeded), ``bytes`` (KV bytes
    WRITEn or landed, every TP rank's), ``seconds`` (each successful room's time from its opening
    to its end), ``failures`` (failed rooms by kind: ``timeout``, ``aborted``, ``unreachable``,
    ``digest``, ``failed``). Rooms are counted on TP rank 0 only; bytes on every rank."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"transfers": 0, "bytes": 0, "seconds": [], "failures": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        data, more = self.data, other.data
        data["transfers"] += more.get("transfers", 0)
        data["bytes"] += more.get("bytes", 0)
        data["seconds"] = [*data["seconds"], *more.get("seconds", ())]
        failures = dict(data["failures"])
        for kind, count in more.get("failures", {}).items():
            failures[kind] = failures.get(kind, 0) + count
        data["failures"] = failures
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data["seconds"]
        out: dict[str, int | float] = {
            "Transfers": self.data["transfers"],
            "MB": round(self.data["bytes"] / 1e6, 3),
            "Avg transfer ms": round(1e3 * sum(seconds) / len(seconds), 3) if seconds else 0.0,
        }
        for kind, count in sorted(self.data["failures"].items()):
            out[f"Failed ({kind})"] = count
        return out

    def is_empty(self) -> bool:
        return not (self.data["transfers"] or self.data["bytes"] or self.data["failures"])


class TransferPromMetrics(KVConnectorPromMetrics):
    """:class:`TransferStats` as Prometheus counters on vLLM's ``/metrics``: ``vllm:te_kv_transfers``,
    ``vllm:te_kv_bytes``, ``vllm:te_kv_failures`` (label ``kind``), and the histogram
    ``vllm:te_kv_transfer_seconds``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetric]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls

        def per_engine(metric: Any) -> dict[int, Any]:
            return {i: metric.labels(*values) for i, values in per_engine_labelvalues.items()}

        self.transfers = per_engine(
            counter(
                name="vllm:te_kv_transfers",
                documentation="KV transfers that succeeded.",
                labelnames=labelnames,
            )
        )
        self.bytes = per_engine(
            counter(
                name="vllm:te_kv_bytes", documentation="KV bytes moved, all TP ranks.", labelnames=labelnames
            )
        )
        self.seconds = per_engine(
            histogram(
                name="vllm:te_kv_transfer_seconds", documentation="Time from a room's opening to its success.",
                labelnames=labelnames, buckets=[0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0, 60.0],
            )
        )  # fmt: skip
        self.failures = counter(
            name="vllm:te_kv_failures", documentation="KV transfers that failed, by kind.",
            labelnames=[*labelnames, "kind"],
        )  # fmt: skip

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        self.transfers[engine_idx].inc(data.get("transfers", 0))
        self.bytes[engine_idx].inc(data.get("bytes", 0))
        for seconds in data.get("seconds", ()):
            self.seconds[engine_idx].observe(seconds)
        for kind, count in data.get("failures", {}).items():
            self.failures.labels(*self.per_engine_labelvalues[engine_idx], kind).inc(count)


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
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
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
        self._max_rooms = 2 * vllm_config.scheduler_config.max_num_seqs
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
    def build_prom_metrics(  # type: ignore[override]
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
        )
        self._core.start()

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
