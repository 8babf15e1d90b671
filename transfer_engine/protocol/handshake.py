"""The PeerHello handshake's decision: whether a prefill rank accepts a decode rank.

Pure: it compares the two ranks' layouts and TP sizes; the engine loads the peer's NIXL agent and
answers with ``PeerHelloAck`` (``ok=False`` and this reason on refusal).
"""

from __future__ import annotations

from transfer_engine.errors import ConfigError
from transfer_engine.protocol import heads
from transfer_engine.protocol import messages as m


def refusal(hello: m.PeerHello, mine: m.LayoutInfo, compat: int, tp_size: int) -> str | None:
    """Why this prefill rank (``mine``, ``compat``, ``tp_size``) refuses ``hello``; None to accept."""
    if hello.compat != compat or hello.layout.mla != mine.mla:
        return f"layout mismatch: decode {hello.layout}, prefill {mine}"
    if not mine.mla:
        try:
            heads.validate_split(mine.num_heads, tp_size, hello.tp_size)
        except ConfigError as exc:
            return str(exc)
    theirs, ours = hello.layout.aux_item_bytes, mine.aux_item_bytes
    if theirs and ours and theirs != ours:
        return f"aux item bytes differ: decode {theirs}, prefill {ours}"
    return None
