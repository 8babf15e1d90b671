"""Real vLLM, disaggregated with our connector: prefill and decode instances in separate processes.

One module-wide set-up (about 2-3 minutes on the 2-core box, most of it vLLM starting): a tiny
random-weight Llama made on the spot; a prefill with TP=1, a prefill with TP=2 and a decode with
TP=1, each a ``vllm.entrypoints.openai.api_server`` process with ``TransferEngineConnector``, on
vLLM's default flags (prefix caching on) but ``--api-key``; one of our (concurrent) routers per
prefill; and two routers of vLLM's standard sequential protocol (``standard_router``): one over
prefill1, one over both prefills. The reference is prefill1 answering without
``kv_transfer_params``: vLLM alone, computing the whole prompt.

What is proven, by vLLM's own ``/metrics`` counters (``prompt_tokens_by_source``): the decode
computed none of the disaggregated prompts (``local_compute`` did not move) and took every prompt
token it had not cached from the transfer (``external_kv_transfer``; cached ones are
``local_cache_hit``). Cancelled requests leave no blocks held (``kv_cache_usage_perc`` 0 on every
instance) and no live room in any engine (``transfer-engine dump``), and the next requests still
match the reference. (The 2-core box runs no second decode instance: P=1 -> D=2 is not tested.)
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tools.tiny_model import CONFIG as MODEL_CONFIG
from tools.tiny_model import make_model
from transfer_engine.observe.cli import fetch_snapshot
from transfer_engine.observe.schema import RoomSnapshot

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

START_TIMEOUT = 420.0
API_KEY = "te-test-key"
"""Every vLLM server requires it: each request through a router proves the router forwards it."""
BLOCK_BYTES = 2 * 4 * 32 * 2 * 32 * 4
"""One block of the decode's KV: layers x KV heads x block size x (K and V) x head_dim x fp32."""
CONNECTOR = {
    "kv_connector": "TransferEngineConnector",
    "kv_connector_module_path": "transfer_engine.integrations.vllm.connector",
}

LIVENESS = {"heartbeat_interval": 30.0, "connect_timeout": 120.0, "bootstrap_timeout": 300.0}
"""Four vLLM workers share the 2-core box. An engine's loop was seen stalled here for up to 58 s
while the servers ran in sessions of their own (the autogroup starvation :func:`spawn` avoids);
liveness is not what this test is about (tests/chaos and tests/vllm/test_leases.py are), so its
windows stay wide. ``bootstrap_timeout`` is far above the 90 s that
:func:`assert_nothing_held` allows, so a room can only pass it by ending for its own reasons."""

_taken: set[int] = set()


def free_port() -> int:
    """A free port outside Linux's ephemeral range (32768-60999), where the vLLM processes bind
    their own random ports: a port picked there could be taken again before our process binds it."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        if port in _taken or port + 1 in _taken:
            continue
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port))
            _taken.add(port)
            return port


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    port: int = 0

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@dataclass
class Setup:
    decode: Proc
    prefill1: Proc
    prefill2: Proc
    router1: Proc
    router2: Proc
    std1: Proc
    std2: Proc
    bootstrap1: int
    introspect: list[int]
    prefill_ranks: dict[str, list[list[int]]]
    """Each router's prefill instances (in its round-robin order), each by its ranks' introspection
    ports."""
    tmp: Path


SERVERS: list[Proc] = []
"""The module's processes, for failure messages (filled by the ``setup`` fixture)."""


def spawn(name: str, cmd: list[str], log: Path, port: int, **popen: Any) -> Proc:
    """Start ``cmd`` (output to ``log``) in a process group of its own, for :func:`stop`, and in
    the caller's session. Not a session of its own: with the kernel's autogroup scheduling
    (``kernel.sched_autogroup_enabled=1``, this box's setting) the CPU is shared between sessions
    before threads, and a vLLM CPU worker that busy-waits (``sched_yield`` between reads of its
    scheduler's queue, for a second after each) kept every other session's threads off both cores
    for 1-3 s at a time, up to 46 s in full runs: the engines' loops in the other server, and the
    heartbeats with them (docs/vllm.md, "Sessions and autogroup scheduling")."""
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, process_group=0, **popen)
    return Proc(name, process, log, port)


def serve(
    name: str, tmp: Path, model: Path, port: int, *args: str, env: dict[str, str] | None = None
) -> Proc:
    log = tmp / f"{name}.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
        "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--block-size", "32", "--max-num-seqs", "8", "--served-model-name", "m", "--api-key", API_KEY,
        "--host", "127.0.0.1", *args,
    ]  # fmt: skip
    rpc = tmp / "rpc"  # vLLM's ZMQ ipc sockets, which it would otherwise leave in /tmp
    rpc.mkdir(exist_ok=True)
    full_env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_RPC_BASE_PATH=str(rpc),
        PYTHONWARNINGS="ignore",
        TE_STALL_TRACEBACK=os.environ.get("TE_STALL_TRACEBACK", "5"),  # a held engine loop shows its stacks
        **(env or {}),
    )
    return spawn(name, cmd, log, port, env=full_env)


def router(name: str, tmp: Path, port: int, prefill_port: int, bootstrap: int, decode_port: int) -> Proc:
    log = tmp / f"{name}.log"
    cmd = [
        sys.executable, "-m", "transfer_engine.integrations.vllm.proxy", "--port", str(port),
        "--prefill", f"http://127.0.0.1:{prefill_port}", f"tcp://127.0.0.1:{bootstrap}",
        "--decode", f"http://127.0.0.1:{decode_port}",
    ]  # fmt: skip
    return spawn(name, cmd, log, port)


def standard_router(name: str, tmp: Path, port: int, prefill_ports: list[int], decode_port: int) -> Proc:
    log = tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "tests.vllm.standard_router", "--port", str(port)]
    cmd += [arg for p in prefill_ports for arg in ("--prefill", f"http://127.0.0.1:{p}")]
    cmd += ["--decode", f"http://127.0.0.1:{decode_port}"]
    return spawn(name, cmd, log, port, cwd=Path(__file__).parents[2])


def wait_healthy(procs: list[Proc], path: str = "/health") -> None:
    deadline = time.monotonic() + START_TIMEOUT
    for p in procs:
        while True:
            if p.popen.poll() is not None:
                pytest.fail(f"{p.name} exited with {p.popen.returncode}:\n{p.tail()}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{p.port}{path}", timeout=2).close()
                break
            if time.monotonic() > deadline:
                pytest.fail(f"{p.name} not healthy within {START_TIMEOUT} s:\n{p.tail()}")
            time.sleep(1)


def stop(procs: list[Proc]) -> None:
    for p in procs:
        if p.popen.poll() is None:
            os.killpg(p.popen.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.popen.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.popen.pid, signal.SIGKILL)
            p.popen.wait(10)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("vllm")
    model = tmp / "model"
    make_model(model)
    b1, b2 = free_port(), free_port()
    i_d, i_p1, i_p2 = free_port(), free_port(), free_port()  # i_p2 + 1 serves TP rank 1

    def kv(role: str, **extra: object) -> str:
        extra = {**LIVENESS, **extra}
        return json.dumps({**CONNECTOR, "kv_role": role, "kv_connector_extra_config": extra})

    decode = serve(
        "decode", tmp, model, free_port(), "--kv-transfer-config", kv("kv_consumer", introspect_port=i_d),
    )  # fmt: skip
    prefill1 = serve(
        "prefill1", tmp, model, free_port(), "--max-num-batched-tokens", "512",
        "--kv-transfer-config", kv("kv_producer", bootstrap_port=b1, introspect_port=i_p1, layers_per_write=1),
    )  # fmt: skip
    prefill2 = serve(
        "prefill2", tmp, model, free_port(), "--tensor-parallel-size", "2", "--max-num-batched-tokens", "512",
        "--kv-transfer-config", kv("kv_producer", bootstrap_port=b2, introspect_port=i_p2, layers_per_write=1),
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )  # fmt: skip
    router1 = router("router1", tmp, free_port(), prefill1.port, b1, decode.port)
    router2 = router("router2", tmp, free_port(), prefill2.port, b2, decode.port)
    std1 = standard_router("std1", tmp, free_port(), [prefill1.port], decode.port)
    std2 = standard_router("std2", tmp, free_port(), [prefill1.port, prefill2.port], decode.port)
    procs = [decode, prefill1, prefill2, router1, router2, std1, std2]
    SERVERS[:] = procs
    try:
        wait_healthy([decode, prefill1, prefill2])
        wait_healthy([router1, router2, std1, std2], "/healthz")
        for p in (decode, prefill1, prefill2):  # the first forward of an instance is slow (TP=2: ~30 s)
            complete(p.port, [1, 2, 3], 1)
        p1, p2 = [i_p1], [i_p2, i_p2 + 1]
        ranks = {"router1": [p1], "router2": [p2], "std1": [p1], "std2": [p1, p2]}
        yield Setup(
            decode,
            prefill1,
            prefill2,
            router1,
            router2,
            std1,
            std2,
            b1,
            [i_d, i_p1, i_p2, i_p2 + 1],
            ranks,
            tmp,
        )
    finally:
        stop(procs)


def post(
    port: int, body: dict[str, Any], timeout: float = 300.0, key: str | None = API_KEY
) -> dict[str, Any]:
    """POST a completion; its JSON answer. HTTP errors fail the test with the servers' logs."""
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), headers
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer
    except urllib.error.HTTPError as exc:  # a failed transfer is HTTP 500 (kv_load_failure_policy=fail)
        pytest.fail(f"HTTP {exc.code} from :{port}: {exc.read()[:500]!r}\n{logs_report(SERVERS)}")


def complete(
    port: int,
    prompt: list[int],
    max_tokens: int,
    timeout: float = 300.0,
    params: dict[str, Any] | None = None,
    **fields: Any,
) -> list[int]:
    body: dict[str, Any] = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **fields,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    return list(post(port, body, timeout)["choices"][0]["token_ids"])


def give_up_after(port: int, body: dict[str, Any], seconds: float) -> None:
    """POST ``body`` and close the connection after ``seconds`` without an answer (which must not
    come sooner): a client that gives up while its request waits."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=seconds)
    headers = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        with pytest.raises(TimeoutError):
            conn.getresponse()
    finally:
        conn.close()


def leave_after_first_token(port: int, prompt: list[int], max_tokens: int) -> None:
    """Stream a completion and close the connection as soon as its first token arrived: a client
    that goes away mid-generation (the router and vLLM see the connection close)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    headers = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        response = conn.getresponse()
        assert response.status == 200, response.read()[:500]
        line = response.readline()
        while not line.startswith(b"data: "):
            assert line, "the stream ended before its first token"
            line = response.readline()
        assert b"[DONE]" not in line
    finally:
        conn.close()


def metrics(port: int) -> dict[str, float]:
    """vLLM's counters and gauges on ``port``, by metric name (plus ``[source]`` for by-source
    counters and ``[reason]`` for finished requests; client aborts are not counted there)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            source = re.search(r'(?:source|finished_reason|kind)="([a-z_]+)"', m.group(2) or "")
            name = m.group(1) + (f"[{source.group(1)}]" if source else "")
            out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


def live_rooms(port: int) -> list[RoomSnapshot]:
    """Rooms live in the engine serving introspection on ``port`` (what ``transfer-engine dump``
    shows; asked in-process, as a subprocess takes seconds to start on a loaded box)."""
    return list(fetch_snapshot(f"tcp://127.0.0.1:{port}", timeout=60).rooms)


def writes_posted(ports: list[int]) -> int:
    """WRITEs the engines serving introspection on ``ports`` have posted, in all."""
    return sum(fetch_snapshot(f"tcp://127.0.0.1:{port}", timeout=60).counters.writes_posted for port in ports)


def held_report(rooms: dict[int, list[RoomSnapshot]]) -> str:
    """What is still held, for a failure message: each live room, then :func:`logs_report`."""
    lines = [
        f"engine :{port}: room {r.room} {r.side} {r.state} age {r.age_s:.1f} s, waiting for {r.waiting_for!r}"
        for port, live in rooms.items()
        for r in live
    ]
    return "\n".join([*lines, logs_report(SERVERS)])


OURS = re.compile(r"transfer_engine|room \d|heartbeat|declared dead|stalled|Error|Traceback")


def logs_report(procs: list[Proc]) -> str:
    """For a failure message: each process's log lines from our connector and engine (their
    warnings and errors reach vLLM's log through Python's last-resort handler) and vLLM's errors,
    then the last lines of the log."""
    lines = []
    for p in procs:
        text = p.log.read_text(errors="replace").splitlines()
        ours = [line for line in text if OURS.search(line)]
        lines.append(f"--- {p.name}: {len(ours)} connector/engine/error lines, last 40:")
        lines.extend(ours[-40:])
        lines.append(f"--- {p.name}: last 15 lines:")
        lines.extend(text[-15:])
    return "\n".join(lines)


def assert_nothing_held(s: Setup) -> None:
    """No blocks held by any vLLM instance and no live room in any engine (waits up to 90 s)."""
    deadline = time.monotonic() + 90
    while True:
        usage = {
            p.name: metrics(p.port)["vllm:kv_cache_usage_perc"] for p in (s.decode, s.prefill1, s.prefill2)
        }
        rooms = {port: live_rooms(port) for port in s.introspect}
        if not any(usage.values()) and not any(rooms.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"still held after 90 s: KV cache usage {usage}\n{held_report(rooms)}")
        time.sleep(0.5)


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1024) for _ in range(n)] for n in lengths]


def counter_delta(
    port: int, before: dict[str, float], name: str, expect: float | None = None, wait_s: float = 20.0
) -> float:
    """How much ``name`` grew on ``port`` since ``before``. vLLM's connector counters reach
    ``/metrics`` with its next stats updates: given ``expect``, wait up to ``wait_s`` for that value."""
    deadline = time.monotonic() + wait_s
    while True:
        delta = metrics(port).get(name, 0.0) - before.get(name, 0.0)
        if expect is None or delta == expect or time.monotonic() >= deadline:
            return delta
        time.sleep(0.5)


LOCAL = "vllm:prompt_tokens_by_source_total[local_compute]"
EXTERNAL = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
CACHED = "vllm:prompt_tokens_by_source_total[local_cache_hit]"


@pytest.mark.parametrize(
    "which",
    ["router1", "router2", "std1", "std2"],
    ids=["ours-P1-D1", "ours-P2-D1", "std-P1-D1", "std-2P-D1"],
)
def test_decode_tokens_match_vllm_alone_and_decode_computes_no_prompt(setup: Setup, which: str) -> None:
    """Our concurrent router and vLLM's standard sequential protocol (``std2``: two prefill
    instances, one of TP=2, round robin), prompts of 1 to 1,100 tokens (chunked on the prefills)."""
    route = getattr(setup, which)
    one, *batch = prompts(sum(map(ord, which)), (1, 2, 37, 333, 1100))
    before = metrics(setup.decode.port)
    # A prompt of one token: vLLM recomputes the last prompt token of a fully loaded prompt (to
    # sample the next; scheduler ``_update_waiting_for_remote_kv``), which here is all of it.
    assert complete(route.port, one, 12) == complete(setup.prefill1.port, one, 12)
    assert counter_delta(setup.decode.port, before, LOCAL) == 1
    reference = [complete(setup.prefill1.port, p, 12) for p in batch]
    prefills = setup.prefill_ranks[which]
    posted = writes_posted([r for ranks in prefills for r in ranks])
    before = metrics(setup.decode.port)
    disaggregated = [complete(route.port, p, 12) for p in batch]
    assert disaggregated == reference
    # Layer-wise sends with layers_per_write=1: every prefill rank WRITEs each layer of each request
    # on its own (one WRITE per layer, not one per request), and one rank the digest beside.
    layers = MODEL_CONFIG["num_hidden_layers"]
    expected = sum(layers * len(prefills[(i + 1) % len(prefills)]) + 1 for i in range(len(batch)))
    assert writes_posted([r for ranks in prefills for r in ranks]) - posted == expected
    computed = counter_delta(setup.decode.port, before, LOCAL)
    assert computed == 0, f"the decode computed {computed} prompt tokens itself"
    assert counter_delta(setup.decode.port, before, EXTERNAL) == sum(map(len, batch))
    blocks = sum(-(-len(p) // 32) for p in batch)
    assert (
        counter_delta(setup.decode.port, before, "vllm:te_kv_bytes_total", blocks * BLOCK_BYTES)
        == blocks * BLOCK_BYTES
    )
    assert counter_delta(setup.decode.port, before, "vllm:te_kv_transfers_total", len(batch)) == len(batch)
    assert_nothing_held(setup)


def test_with_a_shared_prefix_the_decode_loads_only_the_blocks_it_has_not_cached(setup: Setup) -> None:
    """vLLM's prefix caching on the decode (its default): a request sharing 16 blocks with an
    earlier one takes those from its cache and only the rest from the prefill."""
    first, tail = prompts(21, (600, 150))
    second = first[:512] + tail
    reference = [complete(setup.prefill1.port, p, 8) for p in (first, second)]
    assert complete(setup.std1.port, first, 8) == reference[0]
    before = metrics(setup.decode.port)
    assert complete(setup.std1.port, second, 8) == reference[1]
    assert counter_delta(setup.decode.port, before, LOCAL) == 0
    assert counter_delta(setup.decode.port, before, CACHED) == 512
    assert counter_delta(setup.decode.port, before, EXTERNAL) == len(second) - 512
    uncached_blocks = -(-(len(second) - 512) // 32)
    assert (
        counter_delta(setup.decode.port, before, "vllm:te_kv_bytes_total", 10)
        == uncached_blocks * BLOCK_BYTES
    )
    assert_nothing_held(setup)


FOREIGN_PARAMS = [
    {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1, 2],
     "remote_host": "127.0.0.1", "remote_port": 5600},  # NixlConnector's
    {"do_remote_prefill": True, "transfer_id": 12, "bootstrap": "tcp://127.0.0.1:1"},
    {"do_remote_prefill": "yes", "transfer_id": "t", "bootstrap": ["x"]},
    {"do_remote_prefill": True, "transfer_id": "t", "bootstrap": "tcp://127.0.0.1:1", "block_size": 16},
    {"do_remote_decode": True, "transfer_id": "t"},  # a prefill's params, sent to the decode
]  # fmt: skip


def test_foreign_and_malformed_params_are_computed_locally_and_the_servers_stay_up(setup: Setup) -> None:
    prompt, after = prompts(31, (70, 90))
    expected = complete(setup.prefill1.port, prompt, 6)
    before = metrics(setup.decode.port)
    for params in FOREIGN_PARAMS:
        assert complete(setup.decode.port, prompt, 6, params=params) == expected
    assert counter_delta(setup.decode.port, before, EXTERNAL) == 0
    for params in ({"do_remote_decode": 1}, {"do_remote_prefill": True, "transfer_id": "t"}):
        assert complete(setup.prefill1.port, prompt, 6, params=params) == expected
    decode_log = setup.decode.log.read_text(errors="replace")
    assert "kv_transfer_params key 'remote_engine_id' is not this connector's" in decode_log
    assert "key 'block_size'=16 is not this instance's 32" in decode_log
    for route in (setup.router1, setup.std1):  # and the next disaggregated requests are right
        assert complete(route.port, after, 6) == complete(setup.prefill1.port, after, 6)
    assert_nothing_held(setup)


@pytest.mark.parametrize("which", ["router1", "std1"], ids=["ours", "std"])
def test_n_2_with_sampling_and_min_tokens_match_vllm_alone(setup: Setup, which: str) -> None:
    """Each child of an ``n=2`` request has its own transfer; ``min_tokens`` stays off the prefill leg."""
    prompt = prompts(41, (120,))[0]
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "min_tokens": 6, "n": 2, "temperature": 0.9,
            "seed": 7, "return_token_ids": True}  # fmt: skip
    alone = post(setup.prefill1.port, body)
    before = metrics(setup.decode.port)
    routed = post(getattr(setup, which).port, body)
    tokens = sorted(c["token_ids"] for c in routed["choices"])
    assert tokens == sorted(c["token_ids"] for c in alone["choices"]) and len(tokens) == 2
    assert counter_delta(setup.decode.port, before, LOCAL) == 0
    assert counter_delta(setup.decode.port, before, "vllm:te_kv_transfers_total", 2) == 2
    assert_nothing_held(setup)


def test_our_router_forwards_the_api_key_and_returns_the_prefill_s_error_at_once(setup: Setup) -> None:
    prompt = prompts(51, (40,))[0]
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    for route in (setup.router1, setup.std1):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(
                urllib.request.Request(
                    f"http://127.0.0.1:{route.port}/v1/completions", json.dumps(body).encode(),
                    {"content-type": "application/json"},
                ),
                timeout=60,
            )  # fmt: skip
        refused.value.close()
        assert refused.value.code == 401  # no key: vLLM refuses, so the key the other tests send went through
    too_long = {**body, "prompt": prompts(52, (2100,))[0]}  # over --max-model-len: the prefill answers 400
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(
            urllib.request.Request(
                f"http://127.0.0.1:{setup.router1.port}/v1/completions", json.dumps(too_long).encode(),
                {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"},
            ),
            timeout=60,
        )  # fmt: skip
    with failed.value:
        assert failed.value.code == 400 and b"2048" in failed.value.read()  # vLLM's words, from the prefill
    assert_nothing_held(setup)


def test_our_router_s_health_reflects_its_servers(setup: Setup) -> None:
    health = json.loads(
        urllib.request.urlopen(f"http://127.0.0.1:{setup.router1.port}/healthz", timeout=30).read()
    )
    assert health == {"ok": True, "down": []}
    dead = free_port()  # nothing listens there
    lonely = router("lonely", setup.tmp, free_port(), setup.prefill1.port, setup.bootstrap1, dead)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{lonely.port}/healthz", timeout=30)
                pytest.fail("healthz answered 200 with its decode down")
            except urllib.error.HTTPError as exc:
                with exc:
                    assert exc.code == 503
                    assert json.loads(exc.read()) == {"ok": False, "down": [f"http://127.0.0.1:{dead}"]}
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, f"the router did not start:\n{lonely.tail()}"
                time.sleep(0.5)
    finally:
        stop([lonely])


def test_cancelled_requests_free_their_blocks_on_both_sides(setup: Setup) -> None:
    long1, long2, *batch = prompts(7, (1500, 1400, 45, 200))
    before = metrics(setup.decode.port)
    # 1. The decode holds blocks for a transfer whose prefill never comes, and is cancelled while waiting.
    body = {
        "model": "m", "prompt": long1, "max_tokens": 4, "temperature": 0,
        "kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": "never-prefilled",
            "bootstrap": f"tcp://127.0.0.1:{setup.bootstrap1}",
        },
    }  # fmt: skip
    give_up_after(setup.decode.port, body, 3)
    # 2. A whole disaggregated request cancelled mid-way (its KV came, it is generating), through
    # each of our routers. (A client timeout instead of the first token let a fast run finish the request.)
    for route, prompt in ((setup.router1, long1), (setup.router2, long2)):
        leave_after_first_token(route.port, prompt, 500)
    assert_nothing_held(setup)
    after = metrics(setup.decode.port)
    failed = "vllm:request_success_total[error]"  # vLLM's count of failed requests (HTTP 500)
    assert after[failed] == before[failed]
    # both streamed requests had their whole prompt transferred before the client went away
    assert after[EXTERNAL] - before[EXTERNAL] == len(long1) + len(long2)
    for route in (setup.router1, setup.router2):
        assert [complete(route.port, p, 8) for p in batch] == [
            complete(setup.prefill1.port, p, 8) for p in batch
        ]
        assert "Traceback" not in route.log.read_text(errors="replace")  # the client going away is a log line
    assert_nothing_held(setup)


def test_a_request_cancelled_on_the_decode_before_its_prefill_ran_frees_the_prefills_blocks(
    setup: Setup,
) -> None:
    """The decode's request is cancelled first (its room aborted on prefill1 before prefill1 opened
    it), and only then does prefill1 compute the prompt: prefill1's room fails at once and frees the
    blocks, instead of waiting for a decode that will never ask (until bootstrap_timeout)."""
    prompt = prompts(11, (300,))[0]
    params = {"transfer_id": "cancelled-on-the-decode-first"}
    decode = {**params, "do_remote_prefill": True, "bootstrap": f"tcp://127.0.0.1:{setup.bootstrap1}"}
    give_up_after(
        setup.decode.port, {"model": "m", "prompt": prompt, "max_tokens": 4, "kv_transfer_params": decode}, 3
    )
    assert_nothing_held(setup)  # the decode's room ended: prefill1 heard its Abort
    assert len(complete(setup.prefill1.port, prompt, 1, params={**params, "do_remote_decode": True})) == 1
    assert_nothing_held(setup)
