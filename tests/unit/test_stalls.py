"""``observe.stalls.trace_stalls``: a held loop writes every thread's stack, a running one nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import time, anyio
    from transfer_engine.observe.stalls import trace_stalls

    def hold_the_loop_for(seconds):
        time.sleep(seconds)

    async def main(hold):
        async with anyio.create_task_group() as tg:
            tg.start_soon(trace_stalls, {threshold}, "test")
            await anyio.sleep(2.5 * {threshold})  # running: re-armed every quarter threshold
            print("---", flush=True)
            hold_the_loop_for(hold)
            await anyio.sleep(0.2)
            tg.cancel_scope.cancel()

    anyio.run(main, {hold})
    """
)


def run(hold: float, threshold: float) -> tuple[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(hold=hold, threshold=threshold)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout, out.stderr


def test_a_loop_held_past_the_threshold_writes_the_stack_that_holds_it() -> None:
    stdout, stderr = run(1.0, threshold=0.4)
    assert stdout == "---\n"
    assert "Thread 0x" in stderr, stderr
    assert "in hold_the_loop_for" in stderr, stderr
    assert stderr.count("in hold_the_loop_for") >= 2, "repeated while the stall lasts: " + stderr


def test_a_loop_that_runs_writes_nothing() -> None:
    """A threshold of 2 s: a loop kept off a loaded 2-core box's CPU for a moment is not what this
    test is about."""
    stdout, stderr = run(0.0, threshold=2.0)
    assert stdout == "---\n"
    assert "Thread 0x" not in stderr, stderr


def test_without_a_stderr_file_nothing_is_traced_and_the_loop_goes_on() -> None:
    """An embedding whose stderr has no file descriptor: a warning, no error into the engine's task
    group, and the watchdog is free again for another loop."""
    script = textwrap.dedent(
        """
        import io, sys, anyio, logging
        from transfer_engine.observe import stalls
        logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")

        async def main():
            sys.stderr = io.StringIO()
            with anyio.fail_after(5):
                await stalls.trace_stalls(0.4, "embedded")  # returns: nothing to arm
            assert stalls._owner is None
            print("went on")

        anyio.run(main)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "embedded: stalls not traced: stderr has no file descriptor" in out.stdout, out.stdout
    assert out.stdout.endswith("went on\n"), out.stdout
