"""The KVManager: one TP rank's engine, built from SGLang's ``KVArgs`` and server arguments."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs

from transfer_engine import AuxBuffers, ConfigError, EngineConfig, KVPool, pool_from_pointers
from transfer_engine.facade import BlockingEngine
from transfer_engine.integrations.sglang.kv_args import (
    fill_head_counts,
    pool_from_kv_args,
    refuse_unsupported,
)
from transfer_engine.integrations.sglang.settings import (
    deferred_release_enabled,
    disaggregation_role,
    local_ip,
    registry_host,
    sglang_timeouts,
    te_overrides,
)

__all__ = ["HeldRoom", "KVManager", "PrefillInfo"]


class HeldRoom(Protocol):
    """A decode request the manager keeps for SGLang's deferred release until its room ended
    (:class:`~transfer_engine.integrations.sglang.requests.KVReceiver` is one; the requests module
    sits over this one and is not imported here)."""

    bootstrap_room: int

    def ended(self) -> bool:
        """Whether the room ended: no WRITE of it can land any more."""
        ...


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
        self.role = disaggregation_role(disaggregation_mode)
        self.is_mla_backend = bool(is_mla_backend)
        refuse_unsupported(args, server_args)
        self.enable_deferred_decode_kv_release = deferred_release_enabled()
        if self.role == "decode" and not self.enable_deferred_decode_kv_release:
            raise ConfigError(
                "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0: this backend needs SGLang's deferred "
                "release, so that pages freed on a TP group's failure are not written by another rank"
            )
        tp_size = int(server_args.tp_size)
        if not self.is_mla_backend and not getattr(args, "kv_head_num", None):
            fill_head_counts(args, server_args, tp_size)
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
            config = EngineConfig.from_env(**{**defaults, **te_overrides(defaults)})
        self.config = config
        self.engine = BlockingEngine(config, self.pool)
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._lock = threading.Lock()
        self._held: dict[int, HeldRoom] = {}

    def register_to_bootstrap(self) -> None:
        """Nothing to do: a prefill engine registers with the bootstrap registry as it starts."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's decode asks this before creating receivers; each receiver handshakes itself."""
        with self._lock:
            self.prefill_info_table.setdefault(bootstrap_addr, PrefillInfo())
        return True

    # SGLang's deferred release (its decode transfer queue calls these; see the conn module's docstring)

    def hold(self, receiver: HeldRoom) -> None:
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
