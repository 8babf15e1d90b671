"""Every thread's stack when an engine's event loop is held (``EngineConfig.stall_traceback``).

A loop held for seconds shows only afterwards, as "heartbeat loop stalled" and peers declared dead;
by then whoever held it has let go. :func:`trace_stalls` keeps faulthandler's watchdog armed from
the loop: while the loop runs it re-arms the watchdog every quarter of the threshold, and once the
loop has not done so for the whole threshold the watchdog, a C thread that needs neither the loop
nor the GIL, writes every Python thread's stack to stderr, again every threshold while the stall
lasts. faulthandler has one watchdog per process, so one loop per process arms it: the first engine
started with the setting; another logs that it is not traced.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading

import anyio

__all__ = ["trace_stalls"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_owner: str | None = None
"""The loop that holds the process's watchdog now."""


async def trace_stalls(threshold: float, name: str) -> None:
    """Until cancelled: a stall of the calling loop longer than ``threshold`` seconds writes every
    thread's stack to stderr (the module docstring). Returns at once where another loop holds it."""
    global _owner
    with _lock:
        if _owner is not None:
            log.info("%s: stalls not traced (faulthandler's one watchdog is held by %s)", name, _owner)
            return
        _owner = name
    try:
        try:  # stderr may be no file at all where the engine is embedded: then nothing is traced
            faulthandler.dump_traceback_later(threshold, repeat=True, file=sys.stderr)
        except (AttributeError, OSError, ValueError) as exc:
            log.warning("%s: stalls not traced: stderr has no file descriptor (%s)", name, exc)
            return
        log.info(
            "%s: a stall of its loop (thread %#x, tid %d) longer than %g s writes every thread's stack to stderr",
            name,
            threading.get_ident(),
            threading.get_native_id(),
            threshold,
        )
        while True:
            await anyio.sleep(threshold / 4)
            faulthandler.dump_traceback_later(threshold, repeat=True, file=sys.stderr)
    finally:
        faulthandler.cancel_dump_traceback_later()
        with _lock:
            _owner = None
