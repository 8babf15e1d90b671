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

Loading the plugin imports nothing heavy. ``sglang.srt.disaggregation.utils`` imports SGLang's
model configs, and through them torchvision (``configs.nano_nemotron_vl`` ->
``multimodal.internvl_utils``), which a CPU machine may lack; SGLang's launcher process never needs
that module. So where it is imported already (a scheduler process), the hooks go to SGLang's
``HookRegistry``, which applies them and patches the modules that imported the names; where it is
not, a one-shot import hook patches it right after its first import, before any module can import
a name from it. The launcher thus loads the plugin without torchvision, and lists the backend.
"""

from __future__ import annotations

import enum
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["BACKEND", "extend_backends", "get_kv_class_hook", "patch_utils", "register"]

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


def patch_utils(utils: types.ModuleType) -> None:
    """Patch SGLang's ``disaggregation.utils`` module in place (idempotent): its ``TransferBackend``
    extended, its ``get_kv_class`` wrapped. For a module no other module has imported names from."""
    if BACKEND in {member.value for member in utils.TransferBackend}:
        return
    original = utils.get_kv_class

    @functools.wraps(original)
    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        return get_kv_class_hook(original, transfer_backend, class_type)

    utils.TransferBackend = extend_backends(utils.TransferBackend)  # type: ignore[attr-defined]
    utils.get_kv_class = get_kv_class  # type: ignore[attr-defined]


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, and :func:`patch_utils` once the module has run."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        patch_utils(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code...: the module's own loader's
        return getattr(self._loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``sglang.srt.disaggregation.utils`` the first time it is imported (then steps aside)
    and hands it the :class:`_PatchingLoader`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _UTILS:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


_finder = _PatchOnImport()


def register() -> None:
    """The entry point: register this backend's choice and hooks with SGLang (idempotent).

    Imports only SGLang's argument choices and hook registry (the module docstring says why).
    """
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    utils = sys.modules.get(_UTILS)
    if utils is None:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        return
    if BACKEND not in {member.value for member in utils.TransferBackend}:
        HookRegistry.register(
            f"{_UTILS}.TransferBackend", extend_backends(utils.TransferBackend), HookType.REPLACE
        )
        HookRegistry.register(f"{_UTILS}.get_kv_class", get_kv_class_hook, HookType.AROUND)
