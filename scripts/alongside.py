"""Run one command alongside another: ``python scripts/alongside.py LOG 'OTHER COMMAND' MAIN ARGV...``

``make test`` uses it to run the notebooks while the tests run: the tests leave a third of two
cores idle (ranks rendezvousing, kernels starting, subprocesses, the browser), so the two
together take less wall time than one after the other.

* MAIN runs in the foreground: its output is live, as without this script.
* OTHER (a shell command line) runs at the same time with its output going to LOG; when MAIN is
  done, LOG is printed under a header (so the two outputs never interleave).
* The exit status is MAIN's if it failed, else OTHER's: both must pass. Which failed is said.
* Ctrl-C reaches both (OTHER runs in its own process group and gets the interrupt from here);
  SIGTERM to this script interrupts both the same way.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 30       # after an interrupt, how long each command may take to stop before it is killed


def _interrupt(p: subprocess.Popen, group: bool) -> None:
    if p.poll() is None:
        try:
            if group:
                os.killpg(p.pid, signal.SIGINT)
            else:
                p.send_signal(signal.SIGINT)
        except ProcessLookupError:
            pass


def _stop(p: subprocess.Popen, group: bool) -> None:
    """Wait GRACE_S for ``p`` to stop after its interrupt, then kill it (and its group)."""
    try:
        p.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL) if group else p.kill()
        except ProcessLookupError:
            pass
        p.wait()


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    log, other_cmd, main_argv = Path(argv[0]), argv[1], argv[2:]
    log.parent.mkdir(parents=True, exist_ok=True)
    # a shell that started us in the background ignores SIGINT, and so would both commands (an
    # ignored signal stays ignored across exec): handle it here, so that they start with the default
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.monotonic()
    print(f"alongside (output to {log} until the end): {other_cmd}", flush=True)
    with open(log, "wb") as out:
        # its own process group: an interrupt sent here reaches every process it started
        other = subprocess.Popen(other_cmd, shell=True, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)

    terminated = []

    def on_term(signum, frame):
        terminated.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    first = None
    try:
        first = subprocess.Popen(main_argv)
        main_rc = first.wait()
        if other.poll() is None:
            print(f"\nwaiting for: {other_cmd}", flush=True)
        other_rc = other.wait()
    except KeyboardInterrupt:
        # a terminal's Ctrl-C has reached MAIN already (same process group); OTHER has not
        _interrupt(other, group=True)
        if first is not None:
            if terminated:
                _interrupt(first, group=False)
            _stop(first, group=False)
        _stop(other, group=True)
        print(f"\ninterrupted; the output of '{other_cmd}' so far is in {log}", file=sys.stderr)
        return 130
    minutes = (time.monotonic() - t0) / 60
    print(f"\n===== {other_cmd} (ran alongside; {log}) =====", flush=True)
    sys.stdout.buffer.write(log.read_bytes())
    sys.stdout.flush()
    print(f"===== both done in {minutes:.1f} min =====", flush=True)
    if main_rc:
        print(f"FAILED: {' '.join(main_argv)} (exit {main_rc})", flush=True)
    if other_rc:
        print(f"FAILED: {other_cmd} (exit {other_rc}; its output is above and in {log})",
              flush=True)
    return _status(main_rc) or _status(other_rc)


def _status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc          # killed by signal N: 128 + N, as a shell says


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
