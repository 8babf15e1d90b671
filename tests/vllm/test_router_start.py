"""Our vLLM router says where it listens, once it does: one INFO line naming its address and servers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from transfer_engine.testing.cluster import free_port


def test_router_logs_where_it_listens() -> None:
    port = free_port()
    cmd = [
        sys.executable, "-m", "transfer_engine.integrations.vllm.proxy", "--port", str(port),
        "--prefill", "http://127.0.0.1:9", "tcp://127.0.0.1:8998", "--decode", "http://127.0.0.1:10",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        line = ""
        while "listening" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, f"the router exited with {proc.poll()}"
        assert re.fullmatch(
            rf"INFO:[\w.]+:router listening on http://127\.0\.0\.1:{port}; "
            r"prefill http://127\.0\.0\.1:9 \(tcp://127\.0\.0\.1:8998\); decode http://127\.0\.0\.1:10\n",
            line,
        ), line
        try:  # it listens by the time it says so: /healthz answers (503: neither server is up)
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10).close()
            raise AssertionError("/healthz answered 200 with no server up")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()
