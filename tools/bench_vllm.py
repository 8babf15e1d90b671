"""Real vLLM on CPU: the decode's wait for its first token with our connector vs vLLM alone recomputing.

    python tools/bench_vllm.py [--lengths 100 1000] [--reps 5] [--json out.json]

Starts, on this machine, a prefill and a decode ``vllm.entrypoints.openai.api_server`` (TP=1 each,
``TransferEngineConnector``) over a tiny random-weight Llama made on the spot (the model of
``tests/vllm``), warms both up, then for each prompt length and repetition, alternating:

- **alone**: the decode answers a fresh random prompt by itself (no ``kv_transfer_params``): the time
  from sending the request to its first streamed token, i.e. the decode computing the whole prompt;
- **connector**: the tool does what the router does (``transfer_engine.integrations.vllm.proxy``): it
  sends the prompt to the prefill (``max_tokens=1``, ``do_remote_decode``) and to the decode
  (streamed, ``do_remote_prefill``) at once and takes the time from the prefill's answer (its last
  layer ran just before: the answer adds its one sampled token and the HTTP reply) to the decode's
  first streamed token: the KV transfer, the decode's scheduling of the request and its first step.
  Also printed: the prefill's own time to its answer, and the whole connector path (request to the
  decode's first token). The prefill's answer is a proxy for its last layer: its HTTP reply races
  with the transfer, so a single sample can be negative (the decode's token came first).

With ``--routers``: whole requests (``--max-tokens`` tokens, not streamed) through each router,
against the decode alone: vLLM alone (the decode computes the prompt), our concurrent router
(``transfer_engine.integrations.vllm.proxy``) and vLLM's standard sequential protocol
(``tests/vllm/standard_router.py``), each with a fresh prompt of the same length, in turn; prints
the medians and each router's added latency (its median minus vLLM alone's). Run it from the
repository root.

Every prompt is new (no prefix cache hit on either side) and every connector answer is checked
token for token against the decode's answer alone (greedy): a mismatch stops the run. Prints one
line per length: medians and minima in milliseconds. The point on CPU is the shape of the cost with
the prompt length (the tiny model's compute is cheap), not the absolute figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from tiny_model import make_model  # tools/ is on the path of a script run from it

CONNECTOR = {
    "kv_connector": "TransferEngineConnector",
    "kv_connector_module_path": "transfer_engine.integrations.vllm.connector",
}


def free_port() -> int:
    """A free port below Linux's ephemeral range, where vLLM binds its own random ports."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port))
            return port


def serve(
    log: Path, model: Path, port: int, kv_config: dict[str, Any], *args: str
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
        "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--block-size", "32", "--max-num-seqs", "8", "--served-model-name", "m",
        "--kv-transfer-config", json.dumps({**CONNECTOR, **kv_config}), *args,
    ]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONWARNINGS="ignore")
    with log.open("wb") as out:
        # a process group of its own, in our session (autogroup scheduling: tests.vllm.test_disaggregated.spawn)
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=0)


def wait_healthy(port: int, popen: subprocess.Popen[bytes], log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if popen.poll() is not None:
            sys.exit(f"vLLM on port {port} exited with {popen.returncode}; see {log}")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            return
        if time.monotonic() > deadline:
            sys.exit(f"vLLM on port {port} not healthy within {timeout} s; see {log}")
        time.sleep(1)


def post(port: int, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def first_token(port: int, body: dict[str, Any], timeout: float = 300) -> tuple[float, list[int]]:
    """Stream ``body`` from ``port``: (monotonic time of the first token, all token ids)."""
    body = dict(body, stream=True, return_token_ids=True)
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    first = 0.0
    tokens: list[int] = []
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ids = json.loads(line[5:])["choices"][0].get("token_ids") or []
            if ids and not first:
                first = time.monotonic()
            tokens.extend(ids)
    return first, tokens


def measure(decode: int, prefill: int, bootstrap: int, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    base = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    start = time.monotonic()
    first, alone_tokens = first_token(decode, base)
    alone = first - start

    transfer_id = uuid.uuid4().hex
    prefilled: dict[str, float] = {}

    def run_prefill() -> None:
        post(
            prefill,
            dict(
                base, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id}
            ),
        )
        prefilled["at"] = time.monotonic()

    start = time.monotonic()
    thread = threading.Thread(target=run_prefill)
    thread.start()
    params = {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "bootstrap": f"tcp://127.0.0.1:{bootstrap}",
    }
    first, tokens = first_token(decode, dict(base, kv_transfer_params=params))
    thread.join()
    if tokens != alone_tokens:
        sys.exit(f"connector tokens {tokens} differ from vLLM alone {alone_tokens} (prompt of {len(prompt)})")
    return {
        "alone": alone,
        "prefill": prefilled["at"] - start,
        "after_prefill": first - prefilled["at"],
        "connector": first - start,
    }


def timed(port: int, body: dict[str, Any]) -> float:
    start = time.monotonic()
    post(port, body)
    return time.monotonic() - start


def bench_routers(args: argparse.Namespace) -> None:
    """``--routers``: see the module docstring."""
    with tempfile.TemporaryDirectory(prefix="bench_vllm_") as tmp_dir:
        tmp = Path(tmp_dir)
        make_model(tmp / "model")
        d_port, p_port, bootstrap, ours, std = (free_port() for _ in range(5))
        kv = {"kv_role": "kv_producer", "kv_connector_extra_config": {"bootstrap_port": bootstrap}}
        procs = [
            serve(tmp / "decode.log", tmp / "model", d_port, {"kv_role": "kv_consumer"}),
            serve(tmp / "prefill.log", tmp / "model", p_port, kv),
        ]
        routers = [
            [sys.executable, "-m", "transfer_engine.integrations.vllm.proxy", "--port", str(ours),
             "--prefill", f"http://127.0.0.1:{p_port}", f"tcp://127.0.0.1:{bootstrap}",
             "--decode", f"http://127.0.0.1:{d_port}"],
            [sys.executable, "-m", "tests.vllm.standard_router", "--port", str(std),
             "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}"],
        ]  # fmt: skip
        for cmd in routers:
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, process_group=0)
            )
        try:
            wait_healthy(d_port, procs[0], tmp / "decode.log")
            wait_healthy(p_port, procs[1], tmp / "prefill.log")
            time.sleep(3)  # the routers start in well under that
            rng = random.Random(2)

            def body(n: int, max_tokens: int) -> dict[str, Any]:
                prompt = [rng.randrange(1, 1024) for _ in range(n)]
                return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}

            for port in (d_port, ours, std, ours, std):  # first forwards; the first transfer connects
                timed(port, body(64, 2))
            paths = {"alone": d_port, "ours": ours, "standard": std}
            results = {n: {name: [] for name in paths} for n in args.lengths}  # type: dict[int, dict[str, list[float]]]
            for n in args.lengths:
                for _ in range(args.reps):
                    for name, port in paths.items():
                        results[n][name].append(timed(port, body(n, args.max_tokens)))
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
    print(f"vLLM CPU, tiny Llama, TP=1 -> TP=1, {args.max_tokens} tokens a request, {args.reps} reps, ms")
    for n, rows in results.items():
        for stat, pick in (("median", statistics.median), ("min", min)):
            ms = {name: pick(values) * 1e3 for name, values in rows.items()}
            print(
                f"prompt {n:5d} {stat:6s}: vLLM alone {ms['alone']:.1f}; our router {ms['ours']:.1f} "
                f"({ms['ours'] - ms['alone']:+.1f}); standard protocol {ms['standard']:.1f} "
                f"({ms['standard'] - ms['alone']:+.1f})"
            )
    if args.json is not None:
        args.json.write_text(json.dumps({str(n): rows for n, rows in results.items()}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--routers", action="store_true", help="whole requests through each router")
    args = parser.parse_args()
    if args.routers:
        bench_routers(args)
        return

    with tempfile.TemporaryDirectory(prefix="bench_vllm_") as tmp_dir:
        tmp = Path(tmp_dir)
        make_model(tmp / "model")
        d_port, p_port, bootstrap = free_port(), free_port(), free_port()
        decode = serve(
            tmp / "decode.log",
            tmp / "model",
            d_port,
            {"kv_role": "kv_consumer"},
            "--no-enable-prefix-caching",
        )
        prefill = serve(
            tmp / "prefill.log", tmp / "model", p_port,
            {"kv_role": "kv_producer", "kv_connector_extra_config": {"bootstrap_port": bootstrap}},
            "--no-enable-prefix-caching",
        )  # fmt: skip
        try:
            wait_healthy(d_port, decode, tmp / "decode.log")
            wait_healthy(p_port, prefill, tmp / "prefill.log")
            rng = random.Random(1)
            for _ in range(2):  # first forwards are slow; the first transfer connects the engines
                measure(d_port, p_port, bootstrap, [rng.randrange(1, 1024) for _ in range(64)], 2)
            results: dict[int, list[dict[str, Any]]] = {}
            for n in args.lengths:
                results[n] = [
                    measure(
                        d_port, p_port, bootstrap, [rng.randrange(1, 1024) for _ in range(n)], args.max_tokens
                    )
                    for _ in range(args.reps)
                ]
        finally:
            for p in (decode, prefill):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
            for p in (decode, prefill):
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)

    print(f"vLLM CPU, tiny Llama (2 layers, 4 KV heads x 32, fp32), TP=1 -> TP=1, {args.reps} reps, ms")
    for n, rows in results.items():
        line = [f"prompt {n:5d}:"]
        for key, label in (
            ("alone", "vLLM alone, request -> first token"),
            ("after_prefill", "connector, prefill answered -> decode first token"),
            ("prefill", "prefill request -> answer"),
            ("connector", "connector, request -> decode first token"),
        ):
            values = [r[key] * 1e3 for r in rows]
            line.append(f"{label} median {statistics.median(values):.1f} min {min(values):.1f};")
        print(" ".join(line))
    if args.json is not None:
        args.json.write_text(json.dumps({str(n): rows for n, rows in results.items()}, indent=1))


if __name__ == "__main__":
    main()
