"""Real vLLM, disaggregated with our connector: prefill and decode instances in separate processes.

One module-wide set-up (about 2-3 minutes on the 2-core box, most of it vLLM starting): a tiny
random-weight Llama made on the spot; a prefill with TP=1, a prefill with TP=2 and a decode with
TP=1, each a ``vllm.entrypoints.openai.api_server`` process with
``TransferEngineConnector``; and one of our routers per prefill. The reference is the decode
instance itself answering without ``kv_transfer_params``: vLLM alone, computing the whole prompt
(the decode runs without prefix caching, and its external-transfer counter must not move then).

What is proven, by vLLM's own ``/metrics`` counters (``prompt_tokens_by_source``): the decode
computed none of the disaggregated prompts (``local_compute`` did not move) and took every prompt
token from the transfer (``external_kv_transfer``). Cancelled requests leave no blocks held
(``kv_cache_usage_perc`` 0 on every instance) and no live room in any engine (``transfer-engine
dump``), and the next requests still match the reference.
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

from transfer_engine.observe.cli import fetch_snapshot
from transfer_engine.observe.schema import RoomSnapshot

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

START_TIMEOUT = 420.0
MODEL_CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=1024,
    max_position_embeddings=4096,
)
CONNECTOR = {
    "kv_connector": "TransferEngineConnector",
    "kv_connector_module_path": "transfer_engine.integrations.vllm.connector",
}

LIVENESS = {"heartbeat_interval": 30.0, "connect_timeout": 120.0, "bootstrap_timeout": 300.0}
"""Four vLLM workers share the 2-core box: with other jobs loading it (load average 20-40 here) an
engine's loop was seen stalled for up to 58 s, far past the default 10 s lease; liveness is not what
this test is about (tests/chaos is). ``bootstrap_timeout`` is far above the 90 s that
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


def make_model(path: Path) -> None:
    """A random-weight Llama (fixed seed) saved where vLLM can load it; no hub needed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG)).save_pretrained(path)


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
    bootstrap1: int
    introspect: list[int]
    prefill_ranks: dict[str, list[int]]
    """Each router's prefill ranks, by their introspection ports."""


SERVERS: list[Proc] = []
"""The module's processes, for failure messages (filled by the ``setup`` fixture)."""


def serve(
    name: str, tmp: Path, model: Path, port: int, *args: str, env: dict[str, str] | None = None
) -> Proc:
    log = tmp / f"{name}.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
        "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--block-size", "32", "--max-num-seqs", "8", "--served-model-name", "m", *args,
    ]  # fmt: skip
    rpc = tmp / "rpc"  # vLLM's ZMQ ipc sockets, which it would otherwise leave in /tmp
    rpc.mkdir(exist_ok=True)
    full_env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_RPC_BASE_PATH=str(rpc),
        PYTHONWARNINGS="ignore",
        **(env or {}),
    )
    with log.open("wb") as out:
        popen = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    return Proc(name, popen, log, port)


def router(name: str, tmp: Path, port: int, prefill_port: int, bootstrap: int, decode_port: int) -> Proc:
    log = tmp / f"{name}.log"
    cmd = [
        sys.executable, "-m", "transfer_engine.integrations.vllm.proxy", "--port", str(port),
        "--prefill", f"http://127.0.0.1:{prefill_port}", f"tcp://127.0.0.1:{bootstrap}",
        "--decode", f"http://127.0.0.1:{decode_port}",
    ]  # fmt: skip
    with log.open("wb") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Proc(name, popen, log, port)


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
        "decode", tmp, model, free_port(), "--no-enable-prefix-caching",
        "--kv-transfer-config", kv("kv_consumer", introspect_port=i_d),
    )  # fmt: skip
    prefill1 = serve(
        "prefill1", tmp, model, free_port(),
        "--kv-transfer-config", kv("kv_producer", bootstrap_port=b1, introspect_port=i_p1, layers_per_write=1),
    )  # fmt: skip
    prefill2 = serve(
        "prefill2", tmp, model, free_port(), "--tensor-parallel-size", "2",
        "--kv-transfer-config", kv("kv_producer", bootstrap_port=b2, introspect_port=i_p2, layers_per_write=1),
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )  # fmt: skip
    router1 = router("router1", tmp, free_port(), prefill1.port, b1, decode.port)
    router2 = router("router2", tmp, free_port(), prefill2.port, b2, decode.port)
    procs = [decode, prefill1, prefill2, router1, router2]
    SERVERS[:] = procs
    try:
        wait_healthy([decode, prefill1, prefill2])
        wait_healthy([router1, router2], "/healthz")
        for p in (decode, prefill1, prefill2):  # the first forward of an instance is slow (TP=2: ~30 s)
            complete(p.port, [1, 2, 3], 1)
        ranks = {"router1": [i_p1], "router2": [i_p2, i_p2 + 1]}
        yield Setup(decode, prefill1, prefill2, router1, router2, b1, [i_d, i_p1, i_p2, i_p2 + 1], ranks)
    finally:
        stop(procs)


def complete(
    port: int,
    prompt: list[int],
    max_tokens: int,
    timeout: float = 300.0,
    params: dict[str, Any] | None = None,
) -> list[int]:
    body: dict[str, Any] = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return list(json.loads(response.read())["choices"][0]["token_ids"])
    except urllib.error.HTTPError as exc:  # a failed transfer is HTTP 500 (kv_load_failure_policy=fail)
        pytest.fail(f"HTTP {exc.code} from :{port}: {exc.read()[:500]!r}\n{logs_report(SERVERS)}")


def leave_after_first_token(port: int, prompt: list[int], max_tokens: int) -> None:
    """Stream a completion and close the connection as soon as its first token arrived: a client
    that goes away mid-generation (the router and vLLM see the connection close)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
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
            source = re.search(r'(?:source|finished_reason)="([a-z_]+)"', m.group(2) or "")
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


@pytest.mark.parametrize("which", ["router1", "router2"], ids=["P1-D1", "P2-D1"])
def test_decode_tokens_match_vllm_alone_and_decode_computes_no_prompt(setup: Setup, which: str) -> None:
    route = getattr(setup, which)
    batch = prompts(hash(which) & 0xFFFF, (37, 100, 333, 64))
    before = metrics(setup.decode.port)
    reference = [complete(setup.decode.port, p, 12) for p in batch]
    alone = metrics(setup.decode.port)
    assert alone["vllm:prompt_tokens_by_source_total[local_compute]"] - before[
        "vllm:prompt_tokens_by_source_total[local_compute]"
    ] == sum(map(len, batch)), "the reference run computed its prompts"
    assert (
        alone["vllm:prompt_tokens_by_source_total[external_kv_transfer]"]
        == before["vllm:prompt_tokens_by_source_total[external_kv_transfer]"]
    )
    posted = writes_posted(setup.prefill_ranks[which])
    disaggregated = [complete(route.port, p, 12) for p in batch]
    after = metrics(setup.decode.port)
    assert disaggregated == reference
    # Layer-wise sends with layers_per_write=1: every prefill rank WRITEs each layer of each request
    # on its own (one WRITE per layer, not one per request), and one rank the digest beside.
    layers, ranks = MODEL_CONFIG["num_hidden_layers"], len(setup.prefill_ranks[which])
    assert writes_posted(setup.prefill_ranks[which]) - posted == len(batch) * (layers * ranks + 1)
    computed = (
        after["vllm:prompt_tokens_by_source_total[local_compute]"]
        - alone["vllm:prompt_tokens_by_source_total[local_compute]"]
    )
    external = (
        after["vllm:prompt_tokens_by_source_total[external_kv_transfer]"]
        - alone["vllm:prompt_tokens_by_source_total[external_kv_transfer]"]
    )
    assert computed == 0, f"the decode computed {computed} prompt tokens itself"
    assert external == sum(map(len, batch))
    assert_nothing_held(setup)


def test_cancelled_requests_free_their_blocks_on_both_sides(setup: Setup) -> None:
    long_prompt, *batch = prompts(7, (1500, 45, 200))
    before = metrics(setup.decode.port)
    # 1. The decode holds blocks for a transfer whose prefill never comes, and is cancelled while waiting.
    body = {
        "model": "m", "prompt": long_prompt, "max_tokens": 4, "temperature": 0,
        "kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": "never-prefilled",
            "bootstrap": f"tcp://127.0.0.1:{setup.bootstrap1}",
        },
    }  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{setup.decode.port}/v1/completions", json.dumps(body).encode(),
        {"content-type": "application/json"},
    )  # fmt: skip
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        urllib.request.urlopen(request, timeout=3)
    # 2. A whole disaggregated request cancelled mid-way (its KV came, it is generating), through
    # each router. (A client timeout instead of the first token let a fast run finish the request.)
    for route in (setup.router1, setup.router2):
        leave_after_first_token(route.port, long_prompt, 500)
    assert_nothing_held(setup)
    after = metrics(setup.decode.port)
    failed = "vllm:request_success_total[error]"  # vLLM's count of failed requests (HTTP 500)
    assert after[failed] == before[failed]
    # both streamed requests had their whole prompt transferred before the client went away
    transferred = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
    assert after[transferred] - before[transferred] == 2 * len(long_prompt)
    for route in (setup.router1, setup.router2):
        assert [complete(route.port, p, 8) for p in batch] == [
            complete(setup.decode.port, p, 8) for p in batch
        ]
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
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        complete(setup.decode.port, prompt, 4, timeout=3, params=decode)
    assert_nothing_held(setup)  # the decode's room ended: prefill1 heard its Abort
    assert len(complete(setup.prefill1.port, prompt, 1, params={**params, "do_remote_decode": True})) == 1
    assert_nothing_held(setup)
