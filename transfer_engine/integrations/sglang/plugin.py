"""The ``sglang.srt.plugins`` entry point that makes SGLang use this engine as a transfer backend.

SGLang picks its transfer backend from a closed enum (``TransferBackend``) and a function
(``get_kv_class``) in ``sglang.srt.disaggregation.utils``. Out-of-tree backends come in through
its general plugins: every SGLang process calls ``sglang.srt.plugins.load_plugins()`` early, which
runs each installed ``sglang.srt.plugins`` entry point and then applies the hooks they registered
(propagating each patch to the modules that imported the patched name). :func:`register`:

- adds ``transfer_engine`` to the ``--disaggregation-transfer-backend`` choices;
- replaces ``TransferBackend`` with the same enum plus ``TRANSFER_ENGINE = "transfer_engine"``;
- wraps ``get_kv_class`` so that this backend maps to :mod:`transfer_engine.integrations.sglang`'s
  classes, and every other backend to SGLang's own.

pyproject.toml declares it: ``[project.entry-points."sglang.srt.plugins"] transfer_engine = ...``.
``SGLANG_PLUGINS=transfer_engine`` restricts SGLang to this plugin, as for any other.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

__all__ = ["BACKEND", "extend_backends", "get_kv_class_hook", "register"]

BACKEND = "transfer_engine"
"""The value of ``--disaggregation-transfer-backend`` that selects this engine."""

_UTILS = "sglang.srt.disaggregation.utils"


def extend_backends(backends: type[enum.Enum]) -> type[enum.Enum]:
    """``backends`` (SGLang's TransferBackend) with ``TRANSFER_ENGINE`` added, members otherwise equal."""
    members = [(member.name, member.value) for member in backends]
    if BACKEND not in {value for _, value in members}:
        members.append(("TRANSFER_ENGINE", BACKEND))
    extended = enum.Enum(backends.__name__, members, module=backends.__module__)  # type: ignore[misc]
    extended.__qualname__ = backends.__qualname__
    return extended


def get_kv_class_hook(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    """AROUND hook of ``get_kv_class``: this backend's classes for ``transfer_engine``, else SGLang's."""
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(transfer_backend, class_type)
    from transfer_engine.integrations.sglang import conn

    kind = getattr(class_type, "value", class_type)
    if kind == "kvargs":
        return original(transfer_backend, class_type)  # SGLang's KVArgs, shared by every backend
    classes = {
        "manager": conn.KVManager,
        "sender": conn.KVSender,
        "receiver": conn.KVReceiver,
        "bootstrap_server": conn.KVBootstrapServer,
    }
    if kind not in classes:
        raise ValueError(f"class_type={class_type!r} is not one of {sorted(classes)} or kvargs")
    return classes[kind]


def register() -> None:
    """The entry point: register this backend's choice and hooks with SGLang (idempotent).

    Imports ``sglang.srt.disaggregation.utils`` (a full SGLang install), as applying the hooks
    would right after anyway.
    """
    import importlib

    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    utils = importlib.import_module(_UTILS)
    if BACKEND not in {member.value for member in utils.TransferBackend}:
        HookRegistry.register(
            f"{_UTILS}.TransferBackend", extend_backends(utils.TransferBackend), HookType.REPLACE
        )
        HookRegistry.register(f"{_UTILS}.get_kv_class", get_kv_class_hook, HookType.AROUND)
