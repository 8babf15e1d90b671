"""One command for the whole serving example: servers, front door, client, reference, summary line.

    .venv/bin/python -m examples.serving [--prefill-tp 2 --decode-tp 2 --requests 24 ...]

Starts a prefill server (``--prefill-tp`` rank processes) and ``--decode-instances`` decode servers
(``--decode-tp`` each), the HTTP front door in this process, and replays the client's workload
through HTTP. Then it checks that every server freed every page and aux slot and that no engine
holds anything, runs the monolithic reference (same model and TP, one process group, no engine) on
the same prompts, and prints one line, last:

    serving: N requests, tokens identical to the reference N/N, completed ..., ...

A request's tokens are identical when they equal the reference's (a cancelled request: a prefix of
them). The exit status is non-zero when any token differs, a request failed, or anything leaked.
:class:`Cluster` is the same machinery for tests and ``tools/serving_bench.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import anyio.to_thread

from examples import common
from examples.serving import client as client_mod
from examples.serving.frontdoor import FrontDoor
from examples.serving.model import ModelConfig
from examples.serving.reference import RefResult, RefSpec, reference
from examples.serving.server import ServerSpec, pages_for, rank_main
from transfer_engine import ConfigError
from transfer_engine.testing.cluster import free_port


@dataclass(frozen=True)
class ClusterSpec:
    """The servers to start; ``num_pages`` 0 sizes each pool for ``max_requests`` of ``max_tokens``."""

    prefill_tp: int = 2
    decode_tp: int = 2
    decode_instances: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    page_size: int = 16
    chunk_tokens: int = 64
    max_batch_tokens: int = 256
    max_requests: int = 32
    max_tokens: int = 256
    """The longest prompt + generated tokens a request may have (sizes the pools when num_pages is 0)."""
    num_pages: int = 0
    device: str = "cpu"
    record_dir: str = ""
    torch_threads: int = 1
    layerwise: bool = False
    log_level: str = "WARNING"
    engine: dict[str, Any] = field(default_factory=dict)
    page_table: str = "contiguous"
    """The order of each server's free pages at start (``transfer_engine.testing.pagetables.free_order``)."""
    pin: bool = False
    """Pin the prefill's ranks to the first half of this machine's CPUs and the decodes' to the
    second half (a benchmark on a small machine: see docs/DECISIONS.md, "Benchmark method")."""

    def check(self) -> None:
        """ConfigError naming the first bad value."""
        for name in (
            "prefill_tp",
            "decode_tp",
            "decode_instances",
            "page_size",
            "chunk_tokens",
            "max_requests",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.chunk_tokens % self.page_size:
            raise ConfigError(
                f"chunk_tokens={self.chunk_tokens} must be a multiple of page_size={self.page_size}: "
                "each chunk sends whole pages"
            )
        if self.max_batch_tokens < self.chunk_tokens:
            raise ConfigError(
                f"max_batch_tokens={self.max_batch_tokens} is below chunk_tokens={self.chunk_tokens}"
            )
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device={self.device!r} must be 'cpu' or 'cuda'")
        self.model.check(self.prefill_tp)
        self.model.check(self.decode_tp)
        if 0 < self.num_pages < pages_for(self.max_tokens, self.page_size):
            raise ConfigError(
                f"num_pages={self.num_pages} cannot hold one request of max_tokens={self.max_tokens}"
            )

    @property
    def pool_pages(self) -> int:
        return self.num_pages or self.max_requests * pages_for(self.max_tokens, self.page_size)


class Cluster:
    """The servers' rank processes and the front door, as ``async with Cluster(spec) as cluster``."""

    def __init__(self, spec: ClusterSpec) -> None:
        spec.check()
        self.spec = spec
        self.procs: dict[tuple[str, int], list[Any]] = {}
        self.events: Any = None
        self.front: FrontDoor | None = None
        self.url = ""
        bootstrap_port = free_port()
        self.bootstrap = f"tcp://127.0.0.1:{bootstrap_port}"
        common_fields = dict(
            model=spec.model,
            page_size=spec.page_size,
            num_pages=spec.pool_pages,
            max_requests=spec.max_requests,
            chunk_tokens=spec.chunk_tokens,
            max_batch_tokens=spec.max_batch_tokens,
            device=spec.device,
            bootstrap_port=bootstrap_port,
            record_dir=spec.record_dir,
            torch_threads=spec.torch_threads,
            log_level=spec.log_level,
            engine=dict(spec.engine),
            layerwise=spec.layerwise,
            page_table=spec.page_table,
        )
        cpus = sorted(os.sched_getaffinity(0))
        half = max(1, len(cpus) // 2)
        prefill_cpus = tuple(cpus[:half]) if spec.pin else ()
        decode_cpus = tuple(cpus[half:] or cpus) if spec.pin else ()
        self.specs = [
            ServerSpec(
                "prefill",
                0,
                spec.prefill_tp,
                dist_port=free_port(),
                control_port=free_port(),
                cpus=prefill_cpus,
                **common_fields,
            )
        ]  # type: ignore[arg-type]
        for i in range(spec.decode_instances):
            self.specs.append(
                ServerSpec(
                    "decode",
                    i,
                    spec.decode_tp,
                    dist_port=free_port(),
                    control_port=free_port(),
                    cpus=decode_cpus,
                    gpu_offset=spec.prefill_tp + i * spec.decode_tp,  # decode ranks on the next GPUs
                    **common_fields,
                )  # type: ignore[arg-type]
            )

    def alive(self, role: str, instance: int) -> bool:
        return all(p.exitcode is None for p in self.procs.get((role, instance), []))

    def kill(self, role: str, instance: int, rank: int = 0) -> None:
        """SIGKILL one rank process (fault injection)."""
        os.kill(self.procs[(role, instance)][rank].pid, signal.SIGKILL)

    async def __aenter__(self) -> Cluster:
        ctx = mp.get_context("spawn")
        self.events = ctx.Queue()
        for s in self.specs:
            self.procs[(s.role, s.instance)] = [
                ctx.Process(target=rank_main, args=(s, r, self.events), name=f"{s.name}-{r}", daemon=True)
                for r in range(s.tp)
            ]
        try:
            for procs in self.procs.values():
                for p in procs:
                    p.start()
            await self._wait_up(sum(s.tp for s in self.specs), limit_s=120.0)
            prefill = self.specs[0]
            self.front = FrontDoor(
                prefill.control_port,
                [s.control_port for s in self.specs[1:]],
                self.bootstrap,
                self.spec.model.vocab,
                alive=lambda i: self.alive("decode", i),
            )
            self.url = await self.front.start()
        except BaseException:
            await self._stop(graceful=False)
            raise
        return self

    async def _wait_up(self, n: int, limit_s: float) -> None:
        up = 0
        deadline = time.monotonic() + limit_s
        while up < n:
            try:
                kind, _, _ = self.events.get_nowait()
                up += kind == "up"
                continue
            except queue.Empty:
                pass
            dead = [p.name for procs in self.procs.values() for p in procs if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"server rank(s) {dead} exited during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {up} of {n} server ranks came up within {limit_s} s")
            await anyio.sleep(0.05)

    async def stats(self, reset: bool = False) -> dict[str, Any]:
        assert self.front is not None
        return await self.front.stats(reset)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stop(graceful=True)

    async def _stop(self, graceful: bool) -> None:
        with anyio.CancelScope(shield=True):
            if self.front is not None and graceful:
                with contextlib.suppress(Exception):
                    await self.front.stop_servers()
            procs = [p for ps in self.procs.values() for p in ps if p.pid is not None]
            for sig, wait in (
                (None, 30.0 if graceful else 0.0),
                (signal.SIGTERM, 15.0),
                (signal.SIGKILL, 5.0),
            ):
                alive = [p for p in procs if p.exitcode is None]
                if not alive:
                    break
                if sig is not None:
                    for p in alive:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(p.pid, sig)
                deadline = time.monotonic() + wait
                while any(p.exitcode is None for p in alive) and time.monotonic() < deadline:  # noqa: ASYNC110 (no event for a process exit)
                    await anyio.sleep(0.05)
            for p in procs:
                p.join(1)
            if self.front is not None:
                await self.front.close()
            if self.events is not None:
                self.events.close()

    def exit_codes(self) -> dict[str, list[int | None]]:
        return {f"{role}{i}": [p.exitcode for p in ps] for (role, i), ps in self.procs.items()}


def compare(results: list[client_mod.Result], ref: list[RefResult]) -> int:
    """How many requests produced exactly the reference's tokens (a cancelled one: a prefix)."""
    same = 0
    for r in results:
        expected = ref[r.item.index].tokens
        if r.ok and r.tokens == expected:
            same += 1
        elif r.cancelled and r.tokens == expected[: len(r.tokens)]:
            same += 1
    return same


def leftovers(stats: dict[str, Any]) -> list[str]:
    """What the servers still hold after a workload (empty when every page, slot and handle is free)."""
    problems = []
    for name, s in [
        ("prefill", stats["prefill"]),
        *((f"decode{i}", d) for i, d in enumerate(stats["decode"])),
    ]:
        if s is None:
            continue
        if s["pages_free"] != s["pages_total"] or s["aux_free"] != s["aux_total"]:
            problems.append(
                f"{name}: {s['pages_total'] - s['pages_free']} pages / {s['aux_total'] - s['aux_free']} aux held"
            )
        if s["requests_live"] or s["leaks"] or s["handles"]:
            problems.append(
                f"{name}: {s['requests_live']} requests, engine leaks {s['leaks']}, handles {s['handles']}"
            )
    return problems


async def settle(cluster: Cluster, limit_s: float = 30.0) -> dict[str, Any]:
    """Stats once nothing is live any more (cancellations and aborts finish asynchronously)."""
    deadline = time.monotonic() + limit_s
    while True:
        stats = await cluster.stats()
        if not leftovers(stats) or time.monotonic() > deadline:
            return stats
        await anyio.sleep(0.1)


MODEL_SHAPE = ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn")
"""The :class:`ModelConfig` fields of the model's shape."""
MODEL_FIELDS = (*MODEL_SHAPE, "seed")
"""Those and the seed of its weights: what ``python -m examples.serving`` sets."""


def add_model_arguments(parser: argparse._ActionsContainer, fields: tuple[str, ...] = MODEL_FIELDS) -> None:
    """A ``--model-<field>`` flag (``args.model_<field>``, ModelConfig's default) for each of ``fields``."""
    d = ModelConfig()
    for name in fields:
        parser.add_argument(
            f"--model-{name.replace('_', '-')}", type=int, default=getattr(d, name), dest=f"model_{name}"
        )


def model_from(args: argparse.Namespace, fields: tuple[str, ...] = MODEL_FIELDS) -> ModelConfig:
    """The model of the flags of :func:`add_model_arguments` (ModelConfig's defaults for the rest)."""
    return ModelConfig(**{n: getattr(args, f"model_{n}") for n in fields})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m examples.serving",
        description="Disaggregated serving over transfer_engine: a tiny Llama-style model, prefill and "
        "decode servers, an HTTP front door, a workload replay and a monolithic reference.",
        allow_abbrev=False,
    )
    parser.add_argument("--prefill-tp", type=int, default=2, help="prefill TP size (default 2)")
    parser.add_argument("--decode-tp", type=int, default=2, help="decode TP size (default 2)")
    parser.add_argument("--decode-instances", type=int, default=1, help="decode servers (default 1)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument("--chunk-tokens", type=int, default=64, help="chunked prefill size (default 64)")
    parser.add_argument(
        "--max-batch-tokens", type=int, default=256, help="prefill tokens per step (default 256)"
    )
    parser.add_argument(
        "--max-requests", type=int, default=32, help="requests a server holds at once (default 32)"
    )
    parser.add_argument("--torch-threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--no-reference", action="store_true", help="skip the monolithic reference run")
    parser.add_argument(
        "--layerwise",
        action="store_true",
        help="the prefill sends each request's last chunk layer by layer from its forward",
    )
    parser.add_argument("--log-level", default="WARNING", help="log level of the rank processes")
    add_model_arguments(parser.add_argument_group("model (fixed-seed weights)"))
    client_mod.add_workload_arguments(parser)
    return parser.parse_args(argv)


def spec_from(args: argparse.Namespace, items: list[client_mod.Item]) -> ClusterSpec:
    model = model_from(args)
    longest = max((len(it.prompt) + it.max_new for it in items), default=1)
    return ClusterSpec(
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        decode_instances=args.decode_instances,
        model=model,
        page_size=args.page_size,
        chunk_tokens=args.chunk_tokens,
        max_batch_tokens=args.max_batch_tokens,
        max_requests=args.max_requests,
        max_tokens=longest,
        device=args.device,
        torch_threads=args.torch_threads,
        log_level=args.log_level,
        layerwise=args.layerwise,
    )


def run_reference(spec: ClusterSpec, items: list[client_mod.Item]) -> list[RefResult]:
    """The reference for ``items``, at the decode's TP (= the prefill's when P = D)."""
    return reference(
        RefSpec(
            spec.model,
            spec.decode_tp,
            spec.page_size,
            spec.chunk_tokens,
            spec.device,
            free_port(),
            [it.prompt for it in items],
            [it.max_new for it in items],
            spec.torch_threads,
        )
    )


async def serve_workload(
    spec: ClusterSpec, items: list[client_mod.Item]
) -> tuple[list[client_mod.Result], float, list[str]]:
    async with Cluster(spec) as cluster:
        common.say(
            f"serving: prefill TP {spec.prefill_tp}, {spec.decode_instances} decode instance(s) TP {spec.decode_tp}, "
            f"{spec.device}, front door {cluster.url}"
        )
        results, seconds = await client_mod.replay(cluster.url, items)
        problems = leftovers(await settle(cluster))
    return results, seconds, problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model_vocab = args.model_vocab
        items = client_mod.workload_from(args, model_vocab)
        spec = spec_from(args, items)
        spec.check()
    except ConfigError as exc:
        raise SystemExit(f"serving: {exc}") from None
    results, seconds, problems = anyio.run(serve_workload, spec, items)
    for p in problems:
        common.say(f"serving: leaked: {p}")
    for r in results:
        if not (r.ok or r.cancelled):
            common.say(f"serving: request {r.item.index} failed: {r.error}")
    identical = None
    if not args.no_reference:
        if spec.prefill_tp != spec.decode_tp:
            common.say(
                "serving: P != D: tokens are compared, but logits differ in the last bits (see the tests)"
            )
        ref = run_reference(spec, items)
        identical = (compare(results, ref), len(results))
    line = client_mod.summary(results, seconds, identical)
    line += ", every page freed on both sides" if not problems else f", {len(problems)} server(s) leaked"
    common.say(line)
    good = not problems and all(r.ok or r.cancelled for r in results)
    if identical is not None:
        good = good and identical[0] == identical[1]
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
