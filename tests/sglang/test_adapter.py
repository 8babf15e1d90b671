"""The adapter's contract with SGLang's real base classes: types, call order errors, the plugin.

Budget: about 3 s. The plugin is loaded by SGLang's own loader (``load_plugins``) and its hooks
applied to the real ``sglang.srt.disaggregation.utils`` (importable through ``conftest.py``).
"""

from __future__ import annotations

import enum
import time

import numpy as np
import pytest
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferDestination,
)
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

from tests.sglang.rank_memory import SMALL, Memory, manager
from transfer_engine import ConfigError, LayoutError, LocalProtocolError, RoomStatus, TransferFailed
from transfer_engine.integrations.sglang import (
    BACKEND,
    KVBootstrapServer,
    KVManager,
    KVReceiver,
    KVSender,
    register,
)
from transfer_engine.integrations.sglang.plugin import extend_backends, get_kv_class_hook
from transfer_engine.testing.cluster import free_port

pytestmark = pytest.mark.timeout(60)


def test_classes_subclass_sglang_and_status_values_match_kvpoll() -> None:
    assert issubclass(KVManager, BaseKVManager) and issubclass(KVSender, BaseKVSender)
    assert issubclass(KVReceiver, BaseKVReceiver) and issubclass(KVBootstrapServer, BaseKVBootstrapServer)
    for name in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success"):
        assert getattr(KVPoll, name) == RoomStatus[name.upper().replace("FORINPUT", "_FOR_INPUT")]


def test_overlapping_kv_buffers_are_refused_before_anything_starts() -> None:
    memory = Memory.allocate(SMALL, 1, 8, 2)
    memory.kv[3] = memory.kv[2]  # the same buffer twice
    with pytest.raises(LayoutError, match="kv_data_ptrs\\[[23]\\].*overlaps kv_data_ptrs\\[[23]\\]"):
        manager("prefill", SMALL, 1, 0, memory, free_port())


def test_calls_in_the_wrong_order_or_with_bad_values_raise_typed_errors() -> None:
    port = free_port()
    server = KVBootstrapServer("127.0.0.1", port)
    pmem, dmem = Memory.allocate(SMALL, 1, 8, 2), Memory.allocate(SMALL, 1, 8, 2)
    prefill = manager("prefill", SMALL, 1, 0, pmem, port)
    decode = manager("decode", SMALL, 1, 0, dmem, port)
    try:
        sender = KVSender(prefill, f"127.0.0.1:{port}", 11)
        with pytest.raises(LocalProtocolError, match="before init"):
            sender.send(np.array([0], dtype=np.int32))
        with pytest.raises(LayoutError, match="aux slot 5"):
            sender.init(2, 5)
        receiver = KVReceiver(decode, f"127.0.0.1:{port}", 11)
        with pytest.raises(LocalProtocolError, match="before init"):
            receiver.send_metadata(np.array([0], dtype=np.int32), 0)
        with pytest.raises(ConfigError, match="prefill_dp_rank=1"):
            receiver.init(1)
        with pytest.raises(ConfigError, match="bootstrap_addr='nowhere'"):
            KVReceiver(decode, "nowhere", 12).init(0)
        receiver.init(0)
        with pytest.raises(LocalProtocolError, match="twice"):
            receiver.init(0)
        with pytest.raises(ConfigError, match="state_indices"):
            receiver.send_metadata(np.array([0], dtype=np.int32), 0, [np.array([1])])
        with pytest.raises(ConfigError, match="destination"):
            receiver.send_metadata(np.array([0], dtype=np.int32), 0, None, 0, KVTransferDestination.HOST)
        deadline = 100
        while receiver.poll() is not RoomStatus.WAITING_FOR_INPUT and deadline:
            deadline -= 1
            time.sleep(0.02)
        with pytest.raises(LayoutError, match="page 8"):
            receiver.send_metadata(np.array([8], dtype=np.int32), 0)
        with pytest.raises(ConfigError, match="decode_prefix_len=2"):
            receiver.send_metadata(np.array([1], dtype=np.int32), 0, None, 2)
        # the group's MIN said Failed because another rank failed: this rank's live room is aborted
        with pytest.raises(TransferFailed, match="another rank") as info:
            sender.failure_exception()
        assert getattr(info.value, "is_from_another_rank", False)
        receiver.abort()
        for handle in (sender, receiver):
            for _ in range(500):
                if handle.poll() is RoomStatus.FAILED:
                    break
                time.sleep(0.01)
            assert handle.poll() is RoomStatus.FAILED
        for mgr in (prefill, decode):
            assert not any(mgr.engine.leaks().values())
    finally:
        decode.close()
        prefill.close()
        server.close()
    with pytest.raises(LocalProtocolError, match="closed"):
        KVSender(prefill, f"127.0.0.1:{port}", 13)


def test_plugin_entry_point_is_found_by_sglang() -> None:
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert BACKEND in plugins
    func, dist = plugins[BACKEND]
    assert func is register and dist == "transfer-engine"


def test_backend_enum_is_extended_and_get_kv_class_routes_it() -> None:
    Backends = enum.Enum("TransferBackend", [("MOONCAKE", "mooncake"), ("NIXL", "nixl")])
    extended = extend_backends(Backends)
    assert [m.value for m in extended] == ["mooncake", "nixl", BACKEND]
    assert extended(BACKEND).name == "TRANSFER_ENGINE" and extended("nixl").name == "NIXL"
    assert extend_backends(extended) is not extended and len(extend_backends(extended)) == 3

    def original(backend: object, kind: object) -> object:
        return ("sglang", backend, kind)

    Kind = enum.Enum(
        "KVClassType",
        [(n.upper(), n) for n in ("kvargs", "manager", "sender", "receiver", "bootstrap_server")],
    )
    te = extended(BACKEND)
    assert get_kv_class_hook(original, te, Kind("manager")) is KVManager
    assert get_kv_class_hook(original, te, Kind("sender")) is KVSender
    assert get_kv_class_hook(original, te, Kind("receiver")) is KVReceiver
    assert get_kv_class_hook(original, te, Kind("bootstrap_server")) is KVBootstrapServer
    assert get_kv_class_hook(original, te, Kind("kvargs")) == ("sglang", te, Kind("kvargs"))
    nixl = extended("nixl")
    assert get_kv_class_hook(original, nixl, Kind("sender")) == ("sglang", nixl, Kind("sender"))


def test_plugin_applied_to_sglangs_real_utils_routes_its_own_lookup() -> None:
    """SGLang's own loader runs the entry point and applies the hooks to the real module."""
    from sglang.srt.disaggregation import decode, prefill, utils
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.fake import FakeKVSender
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    backend = utils.TransferBackend(BACKEND)
    assert backend.name == "TRANSFER_ENGINE" and utils.TransferBackend("nixl").name == "NIXL"
    kinds = utils.KVClassType
    assert utils.get_kv_class(backend, kinds.MANAGER) is KVManager
    assert utils.get_kv_class(backend, kinds.SENDER) is KVSender
    assert utils.get_kv_class(backend, kinds.RECEIVER) is KVReceiver
    assert utils.get_kv_class(backend, kinds.BOOTSTRAP_SERVER) is KVBootstrapServer
    assert utils.get_kv_class(backend, kinds.KVARGS) is KVArgs
    assert utils.get_kv_class(utils.TransferBackend.FAKE, kinds.SENDER) is FakeKVSender
    # the scheduler modules' own bindings (``from ..utils import get_kv_class``) were patched too
    assert prefill.get_kv_class(prefill.TransferBackend(BACKEND), kinds.SENDER) is KVSender
    assert decode.get_kv_class(decode.TransferBackend(BACKEND), kinds.RECEIVER) is KVReceiver
    args = prepare_server_args(
        [
            "--model-path",
            "unused",
            "--disaggregation-mode",
            "decode",
            "--disaggregation-transfer-backend",
            BACKEND,
        ]
    )
    assert utils.TransferBackend(args.disaggregation_transfer_backend) is backend


def _server_args(**overrides: object) -> object:
    fields = {"tp_size": 1, "pp_size": 1, "dp_size": 1, "enable_dp_attention": False, "attn_dp_size": 1,
              "attn_cp_size": 1, "device": "cpu", "host": "0.0.0.0", "dist_init_addr": None,
              "disaggregation_bootstrap_port": free_port()}  # fmt: skip
    return type("ServerArgs", (), {**fields, **overrides})()


def test_manager_refuses_unsupported_launches_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    memory = Memory.allocate(SMALL, 1, 8, 2)
    before = threading.active_count()
    args = memory.kv_args(SMALL, 1, 0)
    args.state_types, args.state_data_ptrs = ["mamba"], [[memory.kv[0].data_ptr()]]
    with pytest.raises(ConfigError, match="state_types=\\['mamba'\\]"):
        KVManager(args, "prefill", _server_args(), False)
    with pytest.raises(ConfigError, match="--pp-size=2"):
        KVManager(memory.kv_args(SMALL, 1, 0), "prefill", _server_args(pp_size=2), False)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "0")
    with pytest.raises(ConfigError, match="SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0"):
        KVManager(memory.kv_args(SMALL, 1, 0), "decode", _server_args(), False)
    assert threading.active_count() == before, "a refused manager started something"


def test_manager_takes_sglangs_timeouts_and_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = Memory.allocate(SMALL, 1, 8, 2)
    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")  # SGLang's own override of the detected IP
    mgr = KVManager(memory.kv_args(SMALL, 1, 0), "decode", _server_args(), False)
    try:
        cfg = mgr.config
        assert (cfg.bootstrap_timeout, cfg.waiting_timeout, cfg.transfer_timeout) == (300, 300, 300)
        assert (cfg.host, cfg.bootstrap_host) == ("127.0.0.1", "127.0.0.1")
        assert mgr.enable_deferred_decode_kv_release and mgr.supports_deferred_decode_kv_release
    finally:
        mgr.close()
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "7")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "11")
    monkeypatch.setenv("TE_TRANSFER_TIMEOUT", "9")  # a TE_* variable wins over SGLang's value
    mgr = KVManager(
        memory.kv_args(SMALL, 1, 0), "decode", _server_args(dist_init_addr="127.0.0.2:5000"), False
    )
    try:
        cfg = mgr.config
        assert (cfg.bootstrap_timeout, cfg.waiting_timeout, cfg.transfer_timeout) == (7, 11, 9)
        assert cfg.bootstrap_host == "127.0.0.2"
    finally:
        mgr.close()
