"""SGLang's KV transfer contract on top of the blocking facade.

SGLang's scheduler is synchronous: one thread per TP rank creates senders and receivers and calls
``init``, ``send``/``send_metadata``, ``poll``, ``failure_exception`` and ``abort`` once per step;
it combines ``poll()`` across its TP group with an all-reduce MIN. Here every one of those calls
returns without waiting for I/O (see :mod:`transfer_engine.facade`); only constructing a
:class:`KVSender` waits for one synchronous step of the engine's loop.

``poll()`` returns :class:`~transfer_engine.RoomStatus` values, which equal ``KVPoll``'s.
Success and Failed mean this rank's room has ended: no WRITE of it can still land here.

What maps to what (docs/sglang.md has the launch lines and the supported / refused list):

- ``KVArgs`` becomes the engine's pool (:func:`pool_from_kv_args`), in bytes: every buffer is
  viewed as uint8, a head as ``kv_item_lens / (page_size * kv_head_num)`` bytes. The element type
  is never read (``kv_cache_dtype_str`` is ``"auto"``, ``"fp8_e4m3"``, ``"nvfp4"``...): fp8 and
  packed 4-bit KV move bit-exact, and a prefill and a decode whose head widths differ in bytes are
  refused by the engine's handshake. Draft-model buffers (``num_draft_entries``) are layers of
  their own after the target's; ``kv_layer_ids``, ``kv_layout`` and
  ``prefill_start_layer``/``prefill_end_layer`` are checked against that reading.
- The aux buffers are packed per slot (:class:`~transfer_engine.AuxBuffers`): the prefill packs a
  request's aux slot as it sends the last chunk, the decode unpacks it when its poll() first says
  Success.
- The bootstrap address ``host:port`` is the engine's bootstrap registry at ``tcp://host:port``,
  run by :class:`KVBootstrapServer` beside the prefill's HTTP server. Prefill ranks register with
  it at ``dist_init_addr``'s host when that is set, else at ``--host`` (a wildcard is the local
  loopback), as SGLang's own backends do; each rank advertises SGLang's local IP
  (``SGLANG_HOST_IP``/``HOST_IP``, else detected) for its control endpoint.
- Timeouts are SGLang's (:func:`sglang_timeouts`): ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` and
  ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s each by default). ``TE_*`` variables override.
- ``KVSender.init(num_kv_indices, aux_index)`` is ``Sender.expect``; each ``send(kv_indices)`` is a
  chunk, the last one being the one that reaches ``num_kv_indices``.
- ``KVReceiver.init(prefill_dp_rank)`` starts the handshake; ``send_metadata(kv_indices,
  aux_index, state_indices, decode_prefix_len)`` is ``Receiver.request``. The prefill learns
  ``decode_prefix_len`` through ``pop_decode_prefix_len()`` and sends only the rest, as SGLang does.
- Group-safe release: SGLang's decode frees a request's pages once the MIN of poll() over its TP
  group says Failed, while another rank's room may still be receiving WRITEs. This backend takes
  part in SGLang's deferred release (``supports_deferred_decode_kv_release``): every rank of the
  group holds the pages until :meth:`KVManager.is_abort_release_safe` is true on all of them, which
  is when this rank's room has ended (a failed decode room ends only once each live writer has
  acknowledged the abort, or died: docs/ARCHITECTURE.md, "The path of a room"). A decode started
  with ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0`` is refused.

Refused at start, in :class:`KVManager` (ConfigError naming the flag): hybrid-model state buffers
(``KVArgs.state_*``: Mamba/GDN, SWA, DSA/NSA), ``--pp-size`` > 1, DP attention, attention context
parallelism, pools with a ``kv_layout`` of their own (DeepSeek V4). Refused per call: host
destinations and ``prefill_dp_rank`` > 0.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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

from transfer_engine import (
    AuxBuffers,
    ConfigError,
    Curve,
    EngineConfig,
    FailureReason,
    KVLayout,
    KVPool,
    LayoutError,
    LocalProtocolError,
    RoomStatus,
    TransferFailed,
    pool_from_pointers,
)
from transfer_engine.facade import BlockingEngine, BlockingReceiver, BootstrapServer

__all__ = [
    "KVBootstrapServer",
    "KVManager",
    "KVReceiver",
    "KVSender",
    "PoolDescription",
    "PrefillInfo",
    "pool_from_kv_args",
    "refuse_unsupported",
    "registry_host",
    "sglang_timeouts",
]

log = logging.getLogger(__name__)

_ENDED = (RoomStatus.SUCCESS, RoomStatus.FAILED)


def _mode(disaggregation_mode: Any) -> str:
    mode = str(getattr(disaggregation_mode, "value", disaggregation_mode)).lower()
    if mode not in ("prefill", "decode"):
        raise ConfigError(f"disaggregation_mode={disaggregation_mode!r} must be prefill or decode")
    return mode


# --- KVArgs -> the engine's pool (pure) -----------------------------------------------------------


@dataclass(frozen=True)
class PoolDescription:
    """What the engine is told about SGLang's pool: a byte layout and its buffers in engine order."""

    layout: KVLayout
    kv_data_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    target_layers: int
    draft_layers: int


def _ints(args: KVArgs, name: str) -> list[int]:
    values = list(getattr(args, name, None) or [])
    for i, value in enumerate(values):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise LayoutError(f"KVArgs.{name}[{i}]={value!r} must be a non-negative integer")
    return [int(v) for v in values]


def _halves(ids: list[int], what: str) -> None:
    """K and V entries of one model carry the same layer ids, increasing."""
    half = len(ids) // 2
    if ids[:half] != ids[half:]:
        raise ConfigError(f"kv_layer_ids {what} {ids}: the V entries' ids differ from the K entries'")
    if any(b <= a for a, b in zip(ids[:half], ids[1:half], strict=False)):
        raise ConfigError(f"kv_layer_ids {what} {ids[:half]}: layer ids must increase")


def pool_from_kv_args(args: KVArgs, is_mla: bool) -> PoolDescription:
    """The engine's byte layout and buffer order from the ``KVArgs`` SGLang builds.

    The entries are the target model's buffers (K of every layer, then V; one latent per layer for
    MLA), then ``num_draft_entries`` of the draft model's in the same order. The engine gets the
    target's layers then the draft's, K before V, each head ``kv_item_lens / (page_size *
    kv_head_num)`` bytes wide. Raises LayoutError / ConfigError naming the first value that does
    not fit; reads no dtype name.
    """
    ptrs, lens, items = _ints(args, "kv_data_ptrs"), _ints(args, "kv_data_lens"), _ints(args, "kv_item_lens")
    if not ptrs or not len(ptrs) == len(lens) == len(items):
        raise LayoutError(
            f"got {len(ptrs)} kv_data_ptrs, {len(lens)} kv_data_lens and {len(items)} kv_item_lens; "
            "need the same number (at least one) of each"
        )
    layout_name = getattr(args, "kv_layout", None)
    if layout_name is not None and str(layout_name).lower() != "nhd":
        raise ConfigError(
            f"KVArgs.kv_layout={layout_name!r}: only token-major (NHD) pools are supported, "
            "not pools with a byte layout of their own (DeepSeek V4)"
        )
    if getattr(args, "mla_compression_ratios", None):
        raise ConfigError(
            f"KVArgs.mla_compression_ratios={args.mla_compression_ratios!r}: compressed-MLA pools "
            "(DeepSeek V4) are not supported"
        )
    draft = int(getattr(args, "num_draft_entries", 0) or 0)
    if not 0 <= draft < len(ptrs):
        raise ConfigError(f"num_draft_entries={draft} must be in [0, {len(ptrs)}) kv_data_ptrs")
    target = len(ptrs) - draft
    per_layer = 1 if is_mla else 2
    for count, what in ((target, "target"), (draft, "draft")):
        if count % per_layer:
            raise LayoutError(
                f"{count} {what} kv_data_ptrs (num_draft_entries={draft}): an MHA pool has K then V "
                "buffers, an even count"
            )
    ids = _ints(args, "kv_layer_ids")
    if ids:
        if len(ids) != len(ptrs):
            raise ConfigError(f"kv_layer_ids has {len(ids)} ids for {len(ptrs)} kv_data_ptrs")
        if not is_mla:
            _halves(ids[:target], "of the target")
            if draft:
                _halves(ids[target:], "of the draft")
    page_size = int(args.page_size)
    if page_size < 1:
        raise LayoutError(f"page_size={page_size} must be a positive integer")
    heads_local = 1 if is_mla else int(args.kv_head_num)
    if heads_local < 1:
        raise LayoutError(f"kv_head_num={heads_local} must be a positive integer")
    row = page_size * heads_local
    head_bytes, rest = divmod(items[0], row)
    if rest or head_bytes < 1:
        raise LayoutError(
            f"kv_item_lens[0]={items[0]} is not page_size={page_size} x kv_head_num={heads_local} x "
            "a whole number of bytes per head"
        )
    for i, (item, length) in enumerate(zip(items, lens, strict=True)):
        if item != items[0]:
            part = "draft" if i >= target else "target"
            raise LayoutError(
                f"kv_item_lens[{i}]={item} ({part}) differs from kv_item_lens[0]={items[0]}: target and "
                "draft buffers must have the same page width"
            )
        if length != lens[0]:
            raise LayoutError(f"kv_data_lens[{i}]={length} differs from kv_data_lens[0]={lens[0]}")
    target_layers, draft_layers = target // per_layer, draft // per_layer
    start = getattr(args, "prefill_start_layer", None)
    if start not in (None, 0):
        raise ConfigError(f"prefill_start_layer={start}: pipeline stages (--pp-size > 1) are not supported")
    # SGLang fills it with its pool's ``end_layer``, the last layer (inclusive: ``layer_num - 1``),
    # or, for a layer-sharded pool, with the layer after the last (exclusive).
    end = getattr(args, "prefill_end_layer", None)
    if end is not None and int(end) not in (target_layers - 1, target_layers):
        raise ConfigError(
            f"prefill_end_layer={end}, but the pool holds {target_layers} target layers from layer 0 "
            f"(its last layer is {target_layers - 1})"
        )
    if is_mla:
        order = list(range(len(ptrs)))
        num_heads = 1
    else:
        t, d = target // 2, draft // 2
        keys = [*range(t), *range(target, target + d)]
        order = [*keys, *(i + t for i in range(t)), *(target + d + i for i in range(d))]
        num_heads = int(args.total_kv_head_num)
    layout = KVLayout(target_layers + draft_layers, num_heads, head_bytes, torch.uint8, page_size, mla=is_mla)
    return PoolDescription(
        layout,
        [ptrs[i] for i in order],
        [lens[i] for i in order],
        [items[i] for i in order],
        target_layers,
        draft_layers,
    )


# --- what is refused at start (pure) --------------------------------------------------------------


def refuse_unsupported(args: KVArgs, server_args: Any) -> None:
    """ConfigError naming the flag of the first thing this backend does not support."""
    states = list(getattr(args, "state_types", None) or [])
    state_ptrs = [p for group in getattr(args, "state_data_ptrs", None) or [] for p in group]
    if states or state_ptrs:
        names = [str(getattr(s, "value", s)) for s in states]
        raise ConfigError(
            f"KVArgs.state_types={names}: hybrid-model state buffers (Mamba/GDN, SWA, DSA/NSA) are not "
            "supported by --disaggregation-transfer-backend transfer_engine"
        )
    if getattr(args, "is_hybrid_mla_backend", False):
        raise ConfigError("KVArgs.is_hybrid_mla_backend=True: hybrid MLA pools are not supported")
    pp = int(getattr(server_args, "pp_size", 1) or 1)
    if pp > 1:
        raise ConfigError(f"--pp-size={pp}: pipeline-parallel prefill is not supported")
    dp = int(getattr(server_args, "attn_dp_size", 1) or 1)
    if getattr(server_args, "enable_dp_attention", False) or dp > 1:
        raise ConfigError(
            f"--enable-dp-attention (attention DP size {dp}, --dp-size="
            f"{getattr(server_args, 'dp_size', 1)}): DP attention is not supported"
        )
    cp = int(getattr(server_args, "attn_cp_size", 1) or 1)
    if cp > 1:
        raise ConfigError(f"--attn-cp-size={cp}: attention context parallelism is not supported")


# --- addresses and timeouts -----------------------------------------------------------------------

_WILDCARD = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def registry_host(server_args: Any) -> str:
    """Where prefill ranks find the bootstrap registry, as SGLang's backends resolve it.

    ``--dist-init-addr``'s host when set (multi-node: the registry runs on node 0), else ``--host``,
    a wildcard bind address being the same family's loopback.
    """
    dist = getattr(server_args, "dist_init_addr", None)
    if dist:
        from sglang.srt.utils.network import NetworkAddress

        return str(NetworkAddress.parse(str(dist)).resolved().host)
    host = str(getattr(server_args, "host", "127.0.0.1") or "")
    return _WILDCARD.get(host, host)


def local_ip() -> str:
    """This rank's address for peers, as SGLang's own backends pick it (``SGLANG_HOST_IP`` first)."""
    from sglang.srt.utils.network import get_local_ip_auto

    return str(get_local_ip_auto("127.0.0.1"))


def sglang_timeouts() -> dict[str, float]:
    """The engine's room deadlines from SGLang's variables and defaults (its ``environ`` module).

    ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` bounds the handshake (``bootstrap_timeout``);
    ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` bounds a decode's wait for its KV once its pages are
    sent, which here spans the prefill's queueing (``waiting_timeout``) and the transfer itself
    (``transfer_timeout``).
    """
    from sglang.srt.environ import envs

    bootstrap = float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get())
    waiting = float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
    return {"bootstrap_timeout": bootstrap, "waiting_timeout": waiting, "transfer_timeout": waiting}


def _deferred_release_enabled() -> bool:
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get())


@dataclass(frozen=True)
class PrefillInfo:
    """What SGLang's decode scheduler reads of a prefill instance (``kv_manager.prefill_info_table``)."""

    dp_size: int = 1
    follow_bootstrap_room: bool = True


class KVManager(BaseKVManager):
    """One TP rank's engine, built from SGLang's ``KVArgs``; created once per scheduler.

    ``server_args`` is read for ``tp_size``, ``pp_size``, DP attention and context parallelism (all
    refused above 1), ``device``, ``disaggregation_bootstrap_port``, ``host`` and
    ``dist_init_addr``. Timeouts come from SGLang's variables (:func:`sglang_timeouts`); every
    engine field can be set with its ``TE_*`` variable (:meth:`EngineConfig.from_env`), which wins;
    ``config``, when given (tests), replaces all of it.
    """

    supports_deferred_decode_kv_release = True

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
        refuse_unsupported(args, server_args)
        self.enable_deferred_decode_kv_release = _deferred_release_enabled()
        if self.role == "decode" and not self.enable_deferred_decode_kv_release:
            raise ConfigError(
                "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0: this backend needs SGLang's deferred "
                "release, so that pages freed on a TP group's failure are not written by another rank"
            )
        tp_size = int(server_args.tp_size)
        if not self.is_mla_backend and not getattr(args, "kv_head_num", None):
            _fill_head_counts(args, server_args, tp_size)
        self.description = pool_from_kv_args(args, self.is_mla_backend)
        device = str(getattr(server_args, "device", "cuda") or "cuda")
        if device == "cuda":
            device = f"cuda:{int(getattr(args, 'gpu_id', 0))}"
        self.aux: AuxBuffers | None = None
        if list(getattr(args, "aux_data_ptrs", None) or []):
            self.aux = AuxBuffers(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, device="cpu")
        desc = self.description
        self.pool: KVPool = pool_from_pointers(
            desc.layout, tp_size, int(args.engine_rank), desc.kv_data_ptrs, desc.kv_data_lens,
            desc.kv_item_lens, device=device, aux=None if self.aux is None else self.aux.packed,
        )  # fmt: skip
        if config is None:
            defaults: dict[str, Any] = {
                "role": self.role,
                "tp_size": tp_size,
                "tp_rank": int(args.engine_rank),
                "host": local_ip(),
                "bootstrap_host": registry_host(server_args),
                "bootstrap_port": int(server_args.disaggregation_bootstrap_port),
                "host_bootstrap": False,
                **sglang_timeouts(),
            }
            config = EngineConfig.from_env(**{**defaults, **_te_overrides(defaults)})
        self.config = config
        self.engine = BlockingEngine(config, self.pool)
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._lock = threading.Lock()
        self._held: dict[int, KVReceiver] = {}

    def register_to_bootstrap(self) -> None:
        """Nothing to do: a prefill engine registers with the bootstrap registry as it starts."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's decode asks this before creating receivers; each receiver handshakes itself."""
        with self._lock:
            self.prefill_info_table.setdefault(bootstrap_addr, PrefillInfo())
        return True

    # SGLang's deferred release (its decode transfer queue calls these; see the module docstring)

    def hold(self, receiver: KVReceiver) -> None:
        """Keep ``receiver`` for :meth:`is_abort_release_safe`; rooms that ended need no keeping."""
        with self._lock:
            for room in [room for room, held in self._held.items() if held.ended()]:
                del self._held[room]
            self._held[receiver.bootstrap_room] = receiver

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """Whether no WRITE of ``bootstrap_room`` can still land in this rank's pages.

        True once this rank's room has ended (Success or Failed); ``required_acks`` is SGLang's
        count of prefill acknowledgements, which the engine's room end already includes.
        """
        with self._lock:
            receiver = self._held.get(bootstrap_room)
        return receiver is None or receiver.ended()

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        with self._lock:
            self._held.pop(bootstrap_room, None)

    def close(self) -> None:
        """Stop the engine (live rooms fail with SHUTDOWN); its thread and NIXL agent are gone after."""
        self.engine.close()

    teardown = close


def _fill_head_counts(args: KVArgs, server_args: Any, tp_size: int) -> None:
    """``kv_head_num`` and ``total_kv_head_num`` where SGLang leaves them unset, as its decode does.

    SGLang's decode fills them only for its staging buffer; the model's KV head count is in the model
    config the server arguments name, and each rank holds ``total // tp_size`` heads (one at least:
    GQA heads are replicated past the head count), as its pools are built.
    """
    total = int(getattr(args, "total_kv_head_num", 0) or 0)
    if total < 1:
        from sglang.srt.configs.model_config import ModelConfig

        total = int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads())
    args.total_kv_head_num = total
    args.kv_head_num = max(1, total // tp_size)


def _te_overrides(defaults: dict[str, Any]) -> dict[str, Any]:
    """The ``TE_*`` variables set for fields given defaults here: they win over SGLang's values."""
    return {
        name: os.environ["TE_" + name.upper()]
        for name in defaults
        if "TE_" + name.upper() in os.environ and name not in ("role", "tp_size", "tp_rank")
    }


def _endpoint(bootstrap_addr: str) -> str:
    addr = bootstrap_addr.removeprefix("tcp://")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"bootstrap_addr={bootstrap_addr!r} must be host:port")
    host = host.strip("[]")
    return f"tcp://{_WILDCARD.get(host, host)}:{port}"


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
    """Decode side of one request; see the module docstring. ``init()`` starts the handshake."""

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
        self._rx = self.kv_mgr.engine.receiver(self.bootstrap_room, _endpoint(self.bootstrap_addr))

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


class KVBootstrapServer(BaseKVBootstrapServer):
    """The bootstrap registry at ``tcp://host:port`` (:class:`~transfer_engine.facade.BootstrapServer`).

    Prefill ranks register their control endpoints here; decode ranks ask it for the prefill
    instance's topology. ``close()`` stops it and joins its thread. CURVE keys come from the
    ``TE_CURVE_*`` variables, as for the engines.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        curve = Curve.from_config(EngineConfig.from_env(role="prefill"))
        self._server = BootstrapServer(host, port, curve=curve)
        self._server.start()
        self.port = self._server.port

    @property
    def endpoint(self) -> str:
        return f"tcp://{_WILDCARD.get(self.host, self.host)}:{self.port}"

    def close(self) -> None:
        self._server.stop()
