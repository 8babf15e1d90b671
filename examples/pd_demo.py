"""Prefill and decode in one command: start both example scripts, show progress, print one summary line.

    python examples/pd_demo.py                       # CPU, prefill TP 2 -> decode TP 1, 200 rooms
    python examples/pd_demo.py --prefill-tp 1 --decode-tp 2 --rooms 50 --path slice
    python examples/pd_demo.py --device cuda          # pools on cuda:<rank>

It picks a free bootstrap port, runs ``prefill.py`` and ``decode.py`` as subprocesses with the same
schedule flags (each starts its rank processes), draws a progress bar on stderr while the decode
ranks verify rooms, and ends with ONE line on stdout:

    pd_demo: rooms verified 200/200, 5.30 GB, 0.21 GB/s, room latency p50 ... p99 ... (...)

GB/s counts the KV (and aux) bytes the decode ranks received and verified, over the time from the
moment the decode ranks were connected to the prefill instance to the last room's verification; room
latency runs from ``receiver()`` to ``wait()`` returning (the slowest decode rank of the room). Both
sides keep up to ``--inflight`` rooms open. The first window's rooms all open at once and queue
behind each other, while later rooms open one at a time as earlier ones are verified: the line
gives the latency of the rooms after the first window, then the first window's slowest room, then
p50 and p99 over all rooms. The fill and the verification stand in for GPU work; on ``--device
cpu`` they run at a lower CPU priority than the engine (``--work-nice``). ``tools/demo_trace.py``
shows where any room's time went (docs/PERF.md, "make demo's tail"). The exit status is non-zero if any room
failed or any byte was wrong, if a side failed, or on ``--timeout``; children are always stopped
(SIGTERM, then SIGKILL) before it exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import common

from transfer_engine.testing.cluster import free_port

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run prefill and decode ranks of the transfer_engine example and verify every byte.",
        allow_abbrev=False,
    )
    parser.add_argument("--prefill-tp", type=int, default=2, help="prefill TP size (default 2)")
    parser.add_argument("--decode-tp", type=int, default=1, help="decode TP size (default 1)")
    parser.add_argument(
        "--path",
        choices=["auto", "direct", "staged", "host", "slice"],
        default="auto",
        help="transfer path the decode side asks for (auto: direct when TP sizes match, else staged)",
    )
    parser.add_argument(
        "--bootstrap-port", type=int, default=0, help="prefill bootstrap port (default 0: pick a free one)"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="stop everything and fail after this long (s)"
    )
    parser.add_argument("--verbose", action="store_true", help="stream the children's output to stderr")
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep the two sides' logs (prefill.log, decode.log) in this directory (default: a temporary one)",
    )
    common.add_workload_arguments(parser)
    args = parser.parse_args(argv)
    if args.prefill_tp < 1 or args.decode_tp < 1:
        parser.error("--prefill-tp and --decode-tp must be >= 1")
    problem = common.check_workload(args)
    if problem:
        parser.error(problem)
    return args


class Child:
    """One side's launcher process, in its own process group so that everything it started can be stopped."""

    def __init__(self, name: str, argv: list[str], log_path: Path, stdout_pipe: bool) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[str] = open(log_path, "w")  # closed in close()
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if stdout_pipe else self._log,
            stderr=self._log,
            text=True,
            bufsize=1,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, grace: float) -> None:
        """SIGTERM the whole group (a graceful shutdown), then SIGKILL whatever is left after ``grace``."""
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self.signal_group(signal.SIGKILL)  # the launcher's ranks too, should any be left behind
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def close(self) -> None:
        self._log.close()

    def tail(self, lines: int = 25) -> str:
        if not self._log.closed:
            self._log.flush()
        text = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if "NIXL INFO" not in ln]
        return "\n".join(text[-lines:])


class Bar:
    """One updating line on stderr: rooms done/total, failures, bytes, elapsed."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.started = time.monotonic()
        self.verified = self.failed = self.bytes = 0
        self.tty = sys.stderr.isatty()
        self._last = 0.0
        self._lock = threading.Lock()

    def update(self, verified: int, failed: int, nbytes: int) -> None:
        with self._lock:
            self.verified, self.failed, self.bytes = verified, failed, nbytes
            self.draw()

    def draw(self, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < (0.1 if self.tty else 2.0):
            return
        self._last = now
        done = self.verified + self.failed
        width = 32
        filled = width * done // max(self.total, 1)
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} rooms"
            f"{f', {self.failed} FAILED' if self.failed else ''}, {common.human_bytes(self.bytes)}, "
            f"{now - self.started:5.1f} s"
        )
        sys.stderr.write(f"\r{line}  " if self.tty else f"{line}\n")
        if final and self.tty:
            sys.stderr.write("\n")
        sys.stderr.flush()


def pump_decode(stream: IO[str], log: IO[str], bar: Bar, verbose: bool) -> None:
    """Read decode.py's stdout: progress lines feed the bar, everything else goes to its log."""
    for line in stream:
        if line.startswith("progress "):
            fields = dict(item.split("=", 1) for item in line.split()[1:])
            bar.update(int(fields["verified"]), int(fields["failed"]), int(fields["bytes"]))
            continue
        log.write(line)
        log.flush()
        if verbose and "NIXL INFO" not in line:
            sys.stderr.write(f"\r[decode] {line}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _interrupt)  # stop the children on SIGTERM too, not only on Ctrl-C
    port = args.bootstrap_port or free_port()
    # Both sides share this machine: divide its CPUs among all ranks (unless told otherwise).
    args.torch_threads = common.torch_threads(args.torch_threads, args.prefill_tp + args.decode_tp)
    workload = common.workload_argv(args)
    plans = common.make_schedule(args)
    with tempfile.TemporaryDirectory(prefix="pd_demo-") as tmp:
        tmpdir = Path(tmp)
        logdir = args.log_dir or tmpdir
        logdir.mkdir(parents=True, exist_ok=True)
        summary_path = tmpdir / "decode.json"
        prefill_argv = [
            sys.executable, str(HERE / "prefill.py"), "--tp", str(args.prefill_tp),
            "--bootstrap-port", str(port), "--path", args.path, *workload,
        ]  # fmt: skip
        decode_argv = [
            sys.executable, str(HERE / "decode.py"), "--tp", str(args.decode_tp),
            "--bootstrap", f"tcp://127.0.0.1:{port}", "--path", args.path,
            "--progress", "lines", "--json-out", str(summary_path), *workload,
        ]  # fmt: skip
        sys.stderr.write(
            f"pd_demo: prefill TP {args.prefill_tp} -> decode TP {args.decode_tp} on {args.device}, "
            f"{len(plans)} rooms of {args.min_tokens}..{args.max_tokens} tokens, {common.layout_text(args)}, "
            f"bootstrap port {port}\n"
        )
        if args.verbose:
            sys.stderr.write(f"  {' '.join(prefill_argv)}\n  {' '.join(decode_argv)}\n")
        bar = Bar(len(plans))
        children: list[Child] = []
        reason = ""
        try:
            prefill = Child("prefill", prefill_argv, logdir / "prefill.log", stdout_pipe=False)
            children.append(prefill)
            decode = Child("decode", decode_argv, logdir / "decode.log", stdout_pipe=True)
            children.append(decode)
            assert decode.proc.stdout is not None
            pump = threading.Thread(
                target=pump_decode, args=(decode.proc.stdout, decode._log, bar, args.verbose), daemon=True
            )
            pump.start()
            deadline = started + args.timeout
            prefill_failed_at: float | None = None
            while decode.returncode is None:
                time.sleep(0.05)
                if time.monotonic() > deadline:
                    reason = f"timed out after {args.timeout:.0f} s"
                    break
                if prefill.returncode not in (None, 0):
                    # The decode side would wait for its rooms to time out; give it a moment to report.
                    prefill_failed_at = prefill_failed_at or time.monotonic()
                    if time.monotonic() - prefill_failed_at > 15:
                        reason = f"prefill exited with status {prefill.returncode}"
                        break
            if decode.returncode is None:
                decode.stop(grace=15)
            pump.join(5)
            bar.draw(final=True)
            # The decode side is done: stop serving (graceful SIGTERM; the ranks report and exit 0
            # when all their rooms succeeded).
            prefill.stop(grace=20)
        except KeyboardInterrupt:
            reason = "interrupted"
        finally:
            for child in children:
                child.stop(grace=10)
                child.close()
        codes = {c.name: c.returncode for c in children}
        summary: dict[str, Any] = {}
        if summary_path.exists():
            with contextlib.suppress(ValueError):
                summary = json.loads(summary_path.read_text())
        ok = (
            not reason
            and codes.get("decode") == 0
            and codes.get("prefill") == 0
            and summary.get("ok") is True
            and summary.get("verified") == len(plans)
        )
        if not ok:
            for child in children:
                sys.stderr.write(f"--- {child.name} (exit status {child.returncode}), last lines ---\n")
                sys.stderr.write(child.tail() + "\n")
    wall = time.monotonic() - started
    verified = summary.get("verified", 0)
    line = (
        f"pd_demo: rooms verified {verified}/{len(plans)}, {common.human_bytes(summary.get('bytes', 0))}, "
        f"{summary.get('gbps', 0.0):.3f} GB/s, room latency p50 {summary.get('steady_p50_ms', float('nan')):.1f} ms "
        f"p99 {summary.get('steady_p99_ms', float('nan')):.1f} ms; the first {summary.get('first_window_rooms', 0)} "
        f"rooms, opened at once at start, queue behind each other: up to "
        f"{summary.get('first_window_max_ms', float('nan')):.1f} ms (all rooms: p50 "
        f"{summary.get('latency_p50_ms', float('nan')):.1f} ms p99 {summary.get('latency_p99_ms', float('nan')):.1f} ms) "
        f"(prefill TP {args.prefill_tp} -> decode TP {args.decode_tp}, {args.device}, path {args.path}, "
        f"wall {wall:.1f} s{'' if ok else ', FAILED: ' + (reason or f'exit status {codes}')})"
    )
    common.say(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
