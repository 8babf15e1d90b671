"""Messages of the serving example: front door <-> server leaders (ZMQ), leader -> ranks (step plans).

Every message is a frozen msgspec Struct, msgpack on the wire, decoded by one typed decoder per
direction: nothing is unpickled. Times are ``time.monotonic()`` seconds, comparable between the
processes of one machine (Linux CLOCK_MONOTONIC is system-wide).
"""

from __future__ import annotations

import msgspec

# --- front door -> server leaders ----------------------------------------------------------------


class PrefillRequest(msgspec.Struct, frozen=True, tag=True):
    """Compute ``prompt``'s KV and first token, and send them to whoever opens ``room``."""

    rid: int
    room: int
    prompt: list[int]
    layerwise: bool | None = None
    """Send this request's last chunk layer by layer (None: the prefill server's ``--layerwise``)."""


class DecodeRequest(msgspec.Struct, frozen=True, tag=True):
    """Receive ``room`` from the prefill instance behind ``bootstrap``, then generate."""

    rid: int
    room: int
    prompt_len: int
    max_new_tokens: int
    bootstrap: str


class Cancel(msgspec.Struct, frozen=True, tag=True):
    """The client went away: stop ``rid`` wherever it is and free what it holds."""

    rid: int


class StatsQuery(msgspec.Struct, frozen=True, tag=True):
    """Ask for :class:`Stats`; ``reset`` starts a new measurement window (lag samples, token count)."""

    reset: bool = False


class Stop(msgspec.Struct, frozen=True, tag=True):
    """Shut the server down (every rank leaves its engine and exits)."""


ToServer = PrefillRequest | DecodeRequest | Cancel | StatsQuery | Stop

# --- server leaders -> front door ----------------------------------------------------------------


class PrefillDone(msgspec.Struct, frozen=True, tag=True):
    """``rid`` left the prefill: sent (``ok``), failed or cancelled (``detail`` says why)."""

    rid: int
    ok: bool
    detail: str
    t_arrived: float
    t_first_chunk: float
    t_kernels_done: float


class Tokens(msgspec.Struct, frozen=True, tag=True):
    """New tokens of ``rid``, in order."""

    rid: int
    tokens: list[int]


class DecodeDone(msgspec.Struct, frozen=True, tag=True):
    """``rid`` ended on the decode. ``t_landed``: every decode rank had every byte."""

    rid: int
    ok: bool
    detail: str
    t_opened: float
    t_landed: float
    t_first_step: float


class Stats(msgspec.Struct, frozen=True, tag=True):
    """A server's resources and its measurement window (the leader's 1 ms ticker, decode tokens)."""

    role: str
    pages_free: int
    pages_total: int
    aux_free: int
    aux_total: int
    requests_live: int
    leaks: int
    """The largest sum of ``engine.leaks()`` over the ranks, as of the last step."""
    handles: int
    """The most room handles any rank still holds."""
    cancelled: int
    """Requests cancelled while they held pages (since start)."""
    lag_ms: list[float]
    decode_tokens: int
    decode_steps: int
    decode_step_s: float
    """Wall time of the window's decode steps (plan broadcast to logits), summed."""
    window_s: float


FromServer = PrefillDone | Tokens | DecodeDone | Stats

# --- leader -> ranks: one plan per step ------------------------------------------------------------


class OpenSend(msgspec.Struct, frozen=True, array_like=True):
    rid: int
    room: int
    prompt_len: int
    pages: list[int]


class OpenRecv(msgspec.Struct, frozen=True, array_like=True):
    rid: int
    room: int
    prompt_len: int
    pages: list[int]
    """The request's pages that receive the prompt's KV."""
    aux_slot: int
    bootstrap: str


class Chunk(msgspec.Struct, frozen=True, array_like=True):
    """A prefill chunk: ``tokens`` at ``start``; after the forward, ``send(send_pages, last)``."""

    rid: int
    tokens: list[int]
    start: int
    page_table: list[int]
    send_pages: list[int]
    last: bool
    aux_slot: int
    layerwise: bool = False
    """A last chunk sent layer by layer (``PrefillRequest.layerwise``)."""


class Step(msgspec.Struct, frozen=True, array_like=True):
    """One decode step of ``rid``: feed ``token`` at ``position``."""

    rid: int
    token: int
    position: int
    page_table: list[int]


class Plan(msgspec.Struct, frozen=True, array_like=True):
    """What every rank does in one step, in this order: open, abort, compute, forget, then report
    ``track``'s rooms in the step's reduction."""

    opens_send: list[OpenSend] = []
    opens_recv: list[OpenRecv] = []
    aborts: list[int] = []
    chunks: list[Chunk] = []
    steps: list[Step] = []
    forgets: list[int] = []
    track: list[int] = []
    stop: bool = False


server_decoder = msgspec.msgpack.Decoder(ToServer)
client_decoder = msgspec.msgpack.Decoder(FromServer)
plan_decoder = msgspec.msgpack.Decoder(Plan)
encode = msgspec.msgpack.encode
