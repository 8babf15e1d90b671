"""Engine configuration: one msgspec Struct, settable from code, ``TE_*`` variables, and CLI flags."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from transfer_engine.errors import ConfigError

Role = Literal["prefill", "decode"]
PathPolicy = Literal["auto", "direct", "slice", "staged", "host"]
StagingMemory = Literal["device", "host"]

_ENV_PREFIX = "TE_"


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything one rank's engine needs to know. Defaults suit a single-machine deployment.

    Two groups, in this order (docs/CONFIGURATION.md has every field in one table): what a user sets
    to deploy the engine (:data:`USER_FIELDS`: role, ranks, addresses, paths, timeouts, security),
    and what a tuner sets to trade latency, CPU and memory (:data:`TUNER_FIELDS`: sizes, poll
    cadences, threads). Every field is also a ``TE_<FIELD>`` variable and a ``--<field>`` flag.
    """

    # --- what users set: role and ranks ---------------------------------------------------------
    role: Role
    tp_size: int = 1
    tp_rank: int = 0
    # --- what users set: addresses --------------------------------------------------------------
    host: str = "127.0.0.1"
    """Address the control ROUTER binds to and that peers are told to connect to."""
    control_port: int = 0
    """0 picks a free port (the real one is what the bootstrap registry hands out)."""
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 8998
    host_bootstrap: bool | None = None
    """Run the bootstrap registry in this engine; None means: on prefill rank 0."""
    introspect_port: int = 0
    """Port of the introspection endpoint (``transfer-engine dump``), bound on ``host``; 0 picks a free
    port (``engine.introspect_endpoint`` says which)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics over HTTP at ``http://{host}:{metrics_port}/metrics`` (0 picks a free
    port); None turns them off. Needs the ``metrics`` extra (prometheus-client)."""
    agent_name: str = ""
    """NIXL agent name; empty derives a unique one from role, rank and process id."""
    # --- what users set: paths and transport ----------------------------------------------------
    path: PathPolicy = "auto"
    """How KV moves: ``auto`` picks per decode rank from the two layouts (:mod:`transfer_engine.protocol.paths`);
    ``direct``, ``slice``, ``staged`` and ``host`` force one."""
    staging_memory: StagingMemory = "device"
    """Where staging buffers and the decode's ring live on the staged paths."""
    kernel_path: bool = True
    """Under ``path="auto"``, rooms between ranks of one host take the kernel path: the decode exports
    its pool at the handshake, each prefill rank maps it and copies chunks with one indexed copy
    (docs/DECISIONS.md, "One kernel between the GPUs of a host"). False: never offered nor mapped."""
    nixl_backend: str = "UCX"
    min_link_gbps: float = 0.0
    """Decode: the floor of the link probe (``transfer_engine.transport.probe``: a timed WRITE of a
    few MiB to each prefill rank that writes to this one, at the first handshake with its instance).
    A pair below it fails the handshake with SlowLinkError naming the transport and the fix, and no
    room is opened on it; with a floor set, the handshake waits for the probe. 0: no floor."""
    refuse_tcp_link: bool = False
    """Decode: refuse a pair whose probe went over TCP (where RDMA or NVLink was expected): the
    handshake fails with SlowLinkError naming the fix (``UCX_NET_DEVICES``, the NIC). False: a GPU
    pool's link over TCP is logged as a warning."""
    max_rooms: int = 4096
    """Rooms live at once on this rank; ``sender()``/``receiver()`` raise RoomLimitError beyond it.
    It bounds what rooms can have outstanding at the workers, ring and scatter actor
    (docs/ARCHITECTURE.md, "Mail without deadlock")."""
    integrity: bool = False
    """Checksum every chunk's bytes as its WRITE starts and verify them where they landed; a mismatch
    fails the room with reason INTEGRITY on both sides (docs/INTEGRITY.md). Off by default until its
    cost meets its goal: on two H100s it took direct c1 from 0.53 to 0.36 of raw NIXL, c8 from 0.76
    to 0.69, and the layer-wise tail from 0.33 to 4.3 ms at 1K tokens (docs/PERF.md, "Integrity")."""
    # --- what users set: timeouts ---------------------------------------------------------------
    bootstrap_timeout: float = 30.0
    waiting_timeout: float | None = None
    transfer_timeout: float = 60.0
    heartbeat_interval: float = 1.0
    room_lease: float = 30.0
    """Seconds a room waiting on its peer lives unless the peer shows it holds it (docs/CONFIGURATION.md)."""
    connect_timeout: float = 5.0
    """How long a single control request (topology, handshake) may wait for its answer."""
    # --- what users set: security ---------------------------------------------------------------
    curve_secret_key_file: str = ""
    """Control-plane CURVE (see ``transfer_engine.transport.security``): the deployment's shared certificate,
    the ``NAME.key_secret`` file ``zmq.auth.create_certificates`` wrote. Empty: no CURVE, plain TCP."""
    curve_public_keys_dir: str = ""
    """Directory of the ``*.key`` certificates whose holders the control and bootstrap sockets
    accept. Set together with ``curve_secret_key_file``, or neither."""

    # --- what tuners set: sizes -----------------------------------------------------------------
    num_workers: int = 4
    """Prefill: transfer workers; jobs are sharded over them by destination decode agent."""
    staging_chunk_pages: int = 64
    """Pages of one staged chunk: the unit the default ring and staging buffer sizes are counted in."""
    ring_bytes: int = 0
    """Decode staging ring size per rank; 0 sizes it to 4 chunks of ``staging_chunk_pages`` pages
    (capped at the size of the KV pool)."""
    staging_bytes: int = 0
    """Prefill staging buffer per worker; 0 sizes it to two chunks of ``staging_chunk_pages`` pages
    (double buffering: the next chunk is gathered while the previous one's WRITE is in flight)."""
    grant_with_request: bool = True
    """Decode, staged paths: the ring may grant a room's first-chunk region when the room opens, so
    that chunk's writers skip the StagingRequest/Grant round trip
    (``protocol.staging.grant_with_request`` decides per room). False: every chunk asks."""
    layers_per_write: int = 4
    """Layer-wise sending (``Sender.begin_chunk``/``layers_ready``): ready layers are gathered into
    one WRITE per decode rank until a group holds at least this many (the chunk's last layer always
    flushes). Fewer layers per WRITE shorten the tail after the forward; more cost fewer WRITEs
    (``tools/bench_layerwise.py`` measures both)."""
    host_pipeline_layers: int = 4
    """Prefill: a whole chunk (``send()``) whose KV on this rank is at least ``pipeline_min_bytes`` is
    written to a decode rank that asked for the host path as groups of this many layers, so that the
    gather of one group, the slow host WRITE of the one before and the decode's scatter overlap
    (docs/DECISIONS.md, "Host-path chunks cut by the prefill room"). 0: whole. The direct and slice
    paths are not cut: there a group's control work costs more than its copy saves."""
    staged_pipeline_layers: int = 0
    """Prefill: as ``host_pipeline_layers``, for a decode rank that asked for the staged path (GPU
    staging): a whole chunk of at least ``pipeline_min_bytes`` goes as groups of this many layers,
    each gathered, WRITTEN and scattered while the next one is (docs/DECISIONS.md, "Staged-path
    chunks cut by the prefill room"). 0 (the default, to be set from ``tools/gpu_e2e.sh pipeline``):
    whole."""
    pipeline_min_bytes: int = 64 << 20
    """The smallest chunk (bytes of KV on this rank) that ``host_pipeline_layers`` and
    ``staged_pipeline_layers`` cut."""
    table_max_descriptors: int = 1 << 25
    """A prefill worker prepares descriptor tables once per decode rank (both whole pools) and makes
    every direct or slice WRITE from two index arrays into them (docs/DECISIONS.md, "Descriptor tables
    made once per peer"); a pair whose table would hand NIXL more descriptors than this a side keeps
    planning and preparing each WRITE's own lists. NIXL 1.5 takes a table as strided rows (a few
    hundred for any pool, no memory per entry), so only a NIXL that needs every entry listed (about
    50 bytes each, counting ours and NIXL's) reaches the default, at 32M entries (about 1.6 GB)."""
    # --- what tuners set: poll cadences ---------------------------------------------------------
    poll_interval: float = 0.0002
    """Sleep between NIXL polls while WRITEs or rooms are live: a quarter of it just after activity;
    when nothing can come, 50x it for 10 s after a peer was added, else 0.25 s
    (``actors.nixl_poller.poll_delay``)."""
    poll_spin: float = 0.0
    """After NIXL activity (a WRITE posted, a room started, a notification) poll without sleeping for
    this long: a sleep costs at least 1 ms (epoll's resolution) and a small WRITE and its notification
    need several progress calls on both sides. 0 turns spinning off (for machines short of cores)."""
    poll_relaxed: float = 0.001
    """A prefill rank's poller looks at the WRITEs of layer groups before their chunk's closing group
    (relaxed WRITEs: nobody waits for their ends yet) every this many seconds (> 0), and their posts
    and ends do not put it in its quick window (``poll_interval / 4`` for 2 ms). Each look takes the
    GIL, from a forward that holds it too; a longer period takes it less often and tells the decode
    of those groups later. The closing group's coming to its worker makes the chunk's WRITEs urgent
    again (docs/DECISIONS.md, "Relaxed looks at the layer groups before the last")."""
    early_drive: float = 0.002
    """After starting the WRITE of the layer group that closes its chunk, the worker's completion
    waiter thread asks NIXL for its state until it has ended, for this many seconds at most. NIXL
    sends a WRITE's notification from that call, so the decode hears of the room's last group without
    waiting for the poller's look on the loop (docs/DECISIONS.md, "A held WRITE is started by the
    completion waiter's thread"). Earlier groups and whole chunks are not driven: a thread looking at
    one woke late for the next group, and a chunk's copy takes milliseconds. 0: off."""
    local_notices: bool = True
    """Landing notices (the kernel path's ``ChunkLanded``) to a peer of this host go by Unix datagram
    instead of ZMQ: one wake of the receiving loop instead of a hand-off through each side's ZMQ I/O
    thread (:mod:`transfer_engine.transport.local`). Off with CURVE. False: always ZMQ."""
    # --- what tuners set: threads ---------------------------------------------------------------
    gil_switch_interval: float = 0.0005
    """The blocking facade (:class:`~transfer_engine.facade.BlockingEngine`) lowers the process's
    ``sys.setswitchinterval`` to this (never raises it) when it starts; 0 leaves it alone. The engine's
    loop thread gives the GIL up in every NIXL call and every wait for I/O, and while a scheduler's
    thread runs Python it gets it back only when that thread is made to drop it: after the interval,
    5 ms by default. With such a thread busy, a one-page room took 10.2 ms at 5 ms and 1.85 ms at
    0.5 ms, against 1.64 ms with no busy thread (CPU box, ``tools/bench_facade.py --busy``; docs/PERF.md,
    "The loop's GIL hand-overs"). A thread is only made to drop the GIL when another waits for it, so
    an idle engine costs the scheduler nothing."""
    nixl_params: dict[str, str] = msgspec.field(default_factory=dict)
    """Backend parameters (``TE_NIXL_PARAMS="a=1,b=2"``). With KV in GPU memory and no ``num_threads``
    here, UCX gets posting threads (``transport.posting.default_params``); ``num_threads=0`` keeps one."""
    nixl_progress_thread: bool = False
    """NIXL's own progress thread. Off by default: the NixlPoller already drives progress, and on
    few cores the extra spinning thread costs latency (2.2 vs 3.3 ms p50 per small room on 2 cores)."""
    trace_steps: int = 0
    """Keep the last this many step marks of rooms (:mod:`transfer_engine.runtime.steptrace`), for
    benchmarks; 0 (the default) records nothing."""
    stall_traceback: float = 0.0
    """When > 0: a stall of the engine's event loop longer than this many seconds writes every
    thread's Python stack to stderr, again every this many seconds while it lasts, so a held loop
    shows what holds it (:mod:`transfer_engine.observe.stalls`; faulthandler's watchdog: one engine
    per process). 0 (the default): off."""

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ConfigError(f"role={self.role!r} must be 'prefill' or 'decode'")
        if self.tp_size < 1:
            raise ConfigError(f"tp_size={self.tp_size} must be >= 1")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank={self.tp_rank} is not in [0, tp_size={self.tp_size})")
        if self.num_workers < 1:
            raise ConfigError(f"num_workers={self.num_workers} must be >= 1")
        if self.max_rooms < 1:
            raise ConfigError(f"max_rooms={self.max_rooms} must be >= 1")
        if self.path not in ("auto", "direct", "slice", "staged", "host"):
            raise ConfigError(f"path={self.path!r} must be one of auto, direct, slice, staged, host")
        if self.staging_memory not in ("device", "host"):
            raise ConfigError(f"staging_memory={self.staging_memory!r} must be 'device' or 'host'")
        for name in (
            "bootstrap_timeout", "transfer_timeout", "heartbeat_interval", "room_lease", "connect_timeout"
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        if self.stall_traceback < 0:
            raise ConfigError(f"stall_traceback={self.stall_traceback} must be >= 0 (0: off)")
        if self.trace_steps < 0:
            raise ConfigError(f"trace_steps={self.trace_steps} must be >= 0")
        if self.poll_spin < 0:
            raise ConfigError(f"poll_spin={self.poll_spin} must be >= 0")
        if self.poll_relaxed <= 0:
            raise ConfigError(f"poll_relaxed={self.poll_relaxed} must be > 0 (the period of a relaxed look)")
        if self.table_max_descriptors < 1:
            raise ConfigError(f"table_max_descriptors={self.table_max_descriptors} must be >= 1")
        if self.early_drive < 0:
            raise ConfigError(f"early_drive={self.early_drive} must be >= 0")
        if self.gil_switch_interval < 0:
            raise ConfigError(f"gil_switch_interval={self.gil_switch_interval} must be >= 0")
        if not isinstance(self.min_link_gbps, int | float) or not 0 <= self.min_link_gbps < float("inf"):
            raise ConfigError(
                f"min_link_gbps={self.min_link_gbps!r} must be a number of GB/s >= 0 (0: no floor)"
            )
        if self.poll_interval <= 0:
            raise ConfigError(f"poll_interval={self.poll_interval} must be > 0")
        if self.waiting_timeout is not None and self.waiting_timeout <= 0:
            raise ConfigError(f"waiting_timeout={self.waiting_timeout} must be > 0 (None: no input deadline)")
        for name in ("ring_bytes", "staging_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0 (0 sizes it automatically)")
        for name in ("host_pipeline_layers", "staged_pipeline_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r} must be an integer >= 0 (0: off)")
        if self.pipeline_min_bytes < 0:
            raise ConfigError(f"pipeline_min_bytes={self.pipeline_min_bytes} must be >= 0")
        if not isinstance(self.layers_per_write, int) or self.layers_per_write < 1:
            raise ConfigError(f"layers_per_write={self.layers_per_write!r} must be an integer >= 1")
        if self.staging_chunk_pages < 1:
            raise ConfigError(f"staging_chunk_pages={self.staging_chunk_pages} must be >= 1")
        for name in ("control_port", "bootstrap_port", "introspect_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name}={getattr(self, name)} is not a TCP port")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port={self.metrics_port} is not a TCP port (None turns metrics off)")
        self._check_curve()

    def _check_curve(self) -> None:
        secret, keys = self.curve_secret_key_file, self.curve_public_keys_dir
        if bool(secret) != bool(keys):
            raise ConfigError(
                f"curve_secret_key_file={secret!r} and curve_public_keys_dir={keys!r}: set both "
                "(CURVE on) or neither (CURVE off)"
            )
        if secret and not os.path.isfile(secret):
            raise ConfigError(f"curve_secret_key_file={secret!r} is not a file")
        if keys and not os.path.isdir(keys):
            raise ConfigError(f"curve_public_keys_dir={keys!r} is not a directory")

    @property
    def bootstrap_endpoint(self) -> str:
        return f"tcp://{self.bootstrap_host}:{self.bootstrap_port}"

    @property
    def hosts_bootstrap(self) -> bool:
        if self.host_bootstrap is None:
            return self.role == "prefill" and self.tp_rank == 0
        return self.host_bootstrap

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> EngineConfig:
        """Build a config from ``TE_<FIELD>`` variables (e.g. ``TE_TP_SIZE=2``), then ``overrides``."""
        env = os.environ if environ is None else environ
        raw: dict[str, Any] = {}
        for name in cls.__struct_fields__:
            key = _ENV_PREFIX + name.upper()
            if key in env:
                raw[name] = env[key]
        raw.update({k: v for k, v in overrides.items() if v is not None})
        if isinstance(raw.get("nixl_params"), str):
            raw["nixl_params"] = _parse_params(raw["nixl_params"])
        return _convert(raw)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
        """Add a ``--flag`` per field (``--tp-size``, ``--ring-bytes``...) defaulting to None."""
        for name in cls.__struct_fields__:
            if name in skip:
                continue
            parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        """Environment first, then the flags that were given, then ``overrides``."""
        given = {k: v for k, v in vars(args).items() if k in cls.__struct_fields__ and v is not None}
        return cls.from_env(**{**given, **overrides})


USER_FIELDS: tuple[str, ...] = (
    "role", "tp_size", "tp_rank",
    "host", "control_port", "bootstrap_host", "bootstrap_port", "host_bootstrap", "introspect_port",
    "metrics_port", "agent_name",
    "path", "staging_memory", "kernel_path", "nixl_backend", "min_link_gbps", "refuse_tcp_link",
    "max_rooms", "integrity",
    "bootstrap_timeout", "waiting_timeout", "transfer_timeout", "heartbeat_interval", "room_lease",
    "connect_timeout", "curve_secret_key_file", "curve_public_keys_dir",
)  # fmt: skip
"""The fields a user sets to deploy the engine, in the order of :class:`EngineConfig`."""

TUNER_FIELDS: tuple[str, ...] = (
    "num_workers", "staging_chunk_pages", "ring_bytes", "staging_bytes", "grant_with_request",
    "layers_per_write", "host_pipeline_layers", "staged_pipeline_layers", "pipeline_min_bytes",
    "table_max_descriptors",
    "poll_interval", "poll_spin", "poll_relaxed", "early_drive", "local_notices",
    "gil_switch_interval", "nixl_params", "nixl_progress_thread", "trace_steps", "stall_traceback",
)  # fmt: skip
"""The fields a tuner sets (sizes, poll cadences, threads), in the order of :class:`EngineConfig`;
defaults measured in docs/PERF.md."""


def _parse_params(text: str) -> dict[str, str]:
    """``"a=1,b=2"`` -> ``{"a": "1", "b": "2"}``; ConfigError naming a malformed item."""
    params: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"nixl_params item {item!r} is not KEY=VALUE")
        params[key.strip()] = value.strip()
    return params


def _convert(raw: dict[str, Any]) -> EngineConfig:
    try:
        return msgspec.convert(raw, EngineConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid engine configuration: {exc}") from None
    except ConfigError:
        raise
