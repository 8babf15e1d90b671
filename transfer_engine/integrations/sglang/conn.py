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

Where each part lives (this module re-exports what SGLang's plugin and the tests import):

- :mod:`~transfer_engine.integrations.sglang.kv_args`: ``KVArgs`` into a pool, and the refusals
  at start (pure);
- :mod:`~transfer_engine.integrations.sglang.settings`: the role, addresses, timeouts and ``TE_*``
  overrides read from SGLang's environment and ``ServerArgs``;
- :mod:`~transfer_engine.integrations.sglang.manager`: :class:`KVManager`, one rank's engine and
  the deferred release's held receivers;
- :mod:`~transfer_engine.integrations.sglang.requests`: :class:`KVSender` and :class:`KVReceiver`;
- :mod:`~transfer_engine.integrations.sglang.bootstrap`: :class:`KVBootstrapServer`.
"""

from __future__ import annotations

from transfer_engine.integrations.sglang.bootstrap import KVBootstrapServer
from transfer_engine.integrations.sglang.kv_args import PoolDescription, pool_from_kv_args, refuse_unsupported
from transfer_engine.integrations.sglang.manager import KVManager, PrefillInfo
from transfer_engine.integrations.sglang.requests import KVReceiver, KVSender
from transfer_engine.integrations.sglang.settings import registry_host, sglang_timeouts

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
