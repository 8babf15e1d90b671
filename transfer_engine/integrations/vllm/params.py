"""What a request's ``kv_transfer_params`` ask of this side: :func:`plan_of` reads and checks them
(keys, types, transfer ID, bootstrap endpoint, block and TP sizes) without raising, and
:func:`room_of` turns a transfer ID into the engine room both sides use."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from transfer_engine import room_id

__all__ = ["MAX_ID_CHARS", "PARAM_KEYS", "Plan", "plan_of", "room_of"]

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
