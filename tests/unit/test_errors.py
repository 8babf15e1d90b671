"""The error taxonomy (STYLE §8): hierarchy, docstrings, and failures rebuilt from ``(reason, detail)``."""

from __future__ import annotations

import inspect

import pytest

from transfer_engine import errors
from transfer_engine.errors import (
    AddressInUseError,
    AddressRangeError,
    BindError,
    ConfigError,
    FailureReason,
    HeadSplitError,
    LayoutError,
    LocalProtocolError,
    PeerUnreachableError,
    ProtocolError,
    RemoteProtocolError,
    RoomInUseError,
    RoomLimitError,
    SlowLinkError,
    StagingError,
    TransferAborted,
    TransferError,
    TransferFailed,
    TransferTimeout,
    TransportError,
    failure_error,
)

# class -> its direct bases, written out from the tree in errors.py's docstring.
HIERARCHY: dict[type[Exception], tuple[type[BaseException], ...]] = {
    TransferError: (Exception,),
    ConfigError: (TransferError, ValueError),
    LayoutError: (ConfigError,),
    HeadSplitError: (ConfigError,),
    RoomInUseError: (ConfigError,),
    RoomLimitError: (TransferError,),
    ProtocolError: (TransferError,),
    LocalProtocolError: (ProtocolError,),
    RemoteProtocolError: (ProtocolError,),
    TransportError: (TransferError,),
    PeerUnreachableError: (TransportError,),
    BindError: (TransportError,),
    AddressInUseError: (BindError,),
    SlowLinkError: (TransportError,),
    AddressRangeError: (TransportError,),
    TransferFailed: (TransferError,),
    TransferAborted: (TransferFailed,),
    TransferTimeout: (TransferFailed,),
    StagingError: (TransferError,),
}

ERROR_CLASSES = [
    obj
    for obj in vars(errors).values()
    if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
]

# reason -> (class raised by wait(), TransferTimeout.phase or None)
FAILURES: dict[FailureReason, tuple[type[TransferFailed], str | None]] = {
    FailureReason.BOOTSTRAP_TIMEOUT: (TransferTimeout, "bootstrap"),
    FailureReason.TRANSFER_TIMEOUT: (TransferTimeout, "transfer"),
    FailureReason.ABORTED: (TransferAborted, None),
    FailureReason.PEER_DEAD: (TransferFailed, None),
    FailureReason.TRANSPORT: (TransferFailed, None),
    FailureReason.PROTOCOL: (TransferFailed, None),
    FailureReason.STAGING: (TransferFailed, None),
    FailureReason.REMOTE: (TransferFailed, None),
    FailureReason.SHUTDOWN: (TransferFailed, None),
    FailureReason.INPUT_TIMEOUT: (TransferTimeout, "input"),
    FailureReason.INTEGRITY: (TransferFailed, None),
}


def test_every_error_class_is_in_the_hierarchy_table() -> None:
    assert set(ERROR_CLASSES) == set(HIERARCHY)
    assert {c.__name__ for c in ERROR_CLASSES} <= set(errors.__all__)


@pytest.mark.parametrize("cls", list(HIERARCHY), ids=lambda c: c.__name__)
def test_hierarchy(cls: type[Exception]) -> None:
    assert cls.__bases__ == HIERARCHY[cls]


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_class_has_a_one_line_docstring(cls: type[Exception]) -> None:
    doc = cls.__dict__.get("__doc__")
    assert doc and doc.strip(), f"{cls.__name__} has no docstring of its own"
    assert "\n" not in doc.strip(), f"{cls.__name__}: the docstring should be one line"


def test_family_relations() -> None:
    assert issubclass(TransferTimeout, TransferFailed) and issubclass(TransferAborted, TransferFailed)
    assert not issubclass(TransferAborted, TransferTimeout) and not issubclass(
        TransferTimeout, TransferAborted
    )
    assert issubclass(ConfigError, ValueError) and issubclass(LayoutError, ValueError)
    assert not issubclass(ProtocolError, ValueError)
    assert not issubclass(TransferFailed, ConfigError)


def test_failure_table_covers_every_reason() -> None:
    assert set(FAILURES) == set(FailureReason)


@pytest.mark.parametrize("reason", list(FailureReason), ids=lambda r: r.name)
def test_failure_error(reason: FailureReason) -> None:
    cls, phase = FAILURES[reason]
    err = failure_error(42, reason, "why it failed")
    assert type(err) is cls
    assert (err.room, err.reason, err.detail) == (42, reason, "why it failed")
    assert str(err) == f"room 42 failed: {reason.name}: why it failed"
    if phase is not None:
        assert isinstance(err, TransferTimeout)
        assert err.phase == phase


def test_timeout_phase_of_a_non_timeout_reason() -> None:
    assert TransferTimeout(1, FailureReason.PEER_DEAD, "x").phase == "unknown"


def test_failure_reasons_are_stable_wire_values() -> None:
    assert {r.name: int(r) for r in FailureReason} == {
        "BOOTSTRAP_TIMEOUT": 1,
        "TRANSFER_TIMEOUT": 2,
        "ABORTED": 3,
        "PEER_DEAD": 4,
        "TRANSPORT": 5,
        "PROTOCOL": 6,
        "STAGING": 7,
        "REMOTE": 8,
        "SHUTDOWN": 9,
        "INPUT_TIMEOUT": 10,
        "INTEGRITY": 11,
    }


def test_errors_with_fields_name_their_values() -> None:
    split = HeadSplitError(6, 4, 2, "neither divides")
    assert (split.num_heads, split.prefill_tp, split.decode_tp) == (6, 4, 2)
    assert str(split) == "no head assignment for H=6, P=4, D=2: neither divides"
    in_use = RoomInUseError(17)
    assert in_use.room == 17 and "room 17" in str(in_use)
    down = PeerUnreachableError("tcp://10.0.0.5:8998", "timed out")
    assert down.endpoint == "tcp://10.0.0.5:8998"
    assert str(down) == "peer tcp://10.0.0.5:8998 unreachable: timed out"
    assert str(PeerUnreachableError("tcp://h:1")) == "peer tcp://h:1 unreachable"
    taken = AddressInUseError("tcp://127.0.0.1:8998", "Address already in use")
    assert taken.address == "tcp://127.0.0.1:8998"
    assert str(taken) == "cannot bind tcp://127.0.0.1:8998: Address already in use"
    assert not isinstance(taken, PeerUnreachableError)  # a local fault is not an unreachable peer
    assert str(BindError("tcp://10.9.9.9:1")) == "cannot bind tcp://10.9.9.9:1"


def test_all_exports_exist() -> None:
    for name in errors.__all__:
        assert hasattr(errors, name), name
