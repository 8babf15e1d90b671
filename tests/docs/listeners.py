"""Run a Python script as ``python SCRIPT`` would, and write every TCP socket it listened on.

    python tests/docs/listeners.py OUT.json SCRIPT [ARGS...]

A thread of the script's own process reads the process's sockets (``/proc/self/fd``) and the
kernel's tables of TCP sockets (``/proc/net/tcp``, ``tcp6``) every few milliseconds while the script
runs; OUT.json gets the ``address:port`` of each socket seen in LISTEN state, and the number of
samples taken. The script runs unchanged (``runpy``, as ``__main__``), and this exits with its status.
"""

from __future__ import annotations

import ipaddress
import json
import os
import runpy
import sys
import threading
import time

LISTEN = "0A"
INTERVAL_S = 0.002


def listening() -> set[str]:
    """``address:port`` of every socket of this process in LISTEN state."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                found.add(address(fields[1]))
    return found


def address(field: str) -> str:
    """``0100007F:1F40`` (the kernel's little-endian words) as ``127.0.0.1:8000``."""
    hexaddr, hexport = field.split(":")
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    return f"{ip}:{int(hexport, 16)}"


def main() -> int:
    out, script, *args = sys.argv[1:]
    seen: set[str] = set()
    samples = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.update(listening())
            samples[0] += 1
            time.sleep(INTERVAL_S)

    sampler = threading.Thread(target=sample, daemon=True, name="listeners")
    sampler.start()
    sys.argv = [script, *args]
    code: int | str | None = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    finally:
        stop.set()
        sampler.join()
        with open(out, "w") as f:
            json.dump({"listening": sorted(seen), "samples": samples[0]}, f)
    return code if isinstance(code, int) else (0 if code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
