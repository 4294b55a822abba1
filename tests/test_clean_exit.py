"""A process that imports minishard exits cleanly, whoever made the process group.

A user's script makes its own group (``init_process_group("gloo")``), trains two steps with
minishard's ``DDP`` and ``AdamW`` and destroys the group (``clean_exit_rank.py``). Without
``launch.release_captured_groups`` the first optimizer's import of ``torch._dynamo`` pinned the
group in ``torch.distributed.nn.functional``'s default arguments, ``destroy_process_group`` freed
nothing, and a gloo worker thread still alive at interpreter exit aborted the process
("terminate called without an active exception", exit code -6): in 1 to 13 runs in 100,
depending on the machine's load. The abort is a race, so each variant (minishard imported before
the group, or after it) runs ``RUNS`` times on two real ranks: at one run in eight, 16 clean runs
happen by chance with probability 0.875**16 = 12% (the suite's 20-minute budget set 8 runs a
variant; ``MINISHARD_CLEAN_EXIT_RUNS=50`` to measure). At the low end of that range the runs are a
backstop; the deterministic check is the second test: on one rank, once the group is destroyed no
function keeps it as a default, nothing else holds it and its threads are gone.
"""
import os
import socket
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("clean_exit_rank.py")
RUNS = int(os.environ.get("MINISHARD_CLEAN_EXIT_RUNS", 8))       # per variant; more to measure
WORLD_SIZE, TIMEOUT_S = 2, 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_once(when: str) -> list[tuple[int, str]]:
    """Start the ranks of one run; (exit code, stderr) per rank."""
    port = _free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(WORLD_SIZE), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), when], cwd=ROOT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(WORLD_SIZE)]
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=TIMEOUT_S)
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def _port_taken(ranks: list[tuple[int, str]]) -> bool:
    return any("address already in use" in err.lower() for _, err in ranks)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_user_made_group_ends_without_an_abort_at_exit(when):
    def run(_):
        ranks = _run_once(when)
        if _port_taken(ranks):                  # another process took the free port: once more
            ranks = _run_once(when)
        return ranks
    failed = []
    # two runs at a time: the ranks mostly wait (import, rendezvous), and a loaded machine is
    # where the race shows, not where it hides
    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(run, range(RUNS)))
    for i, ranks in enumerate(outcomes):
        bad = [(r, code, err) for r, (code, err) in enumerate(ranks)
               if code != 0 or "terminate called" in err]
        if bad:
            failed.append((i, bad))
    if failed:
        aborts = sum(any("terminate called" in err for _, _, err in bad) for _, bad in failed)
        i, bad = failed[0]
        r, code, err = bad[0]
        pytest.fail(f"minishard imported {when} init_process_group: {len(failed)} of {RUNS} runs "
                    f"did not exit cleanly ({aborts} with 'terminate called'); run {i}, rank {r}, "
                    f"exit code {code}, stderr:\n{err[-3000:]}")


ONE_RANK = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    threads = lambda: len(os.listdir("/proc/self/task"))
    when = sys.argv[1]
    before = threads()
    if when == "before":
        import minishard
    dist.init_process_group("gloo", rank=0, world_size=1)
    if when == "after":
        import minishard
    group = dist.group.WORLD
    net = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(net.parameters())        # imports torch._dynamo, with the group alive
    import torch.distributed.nn.functional as F
    captured = [f.__name__ for f in vars(F).values() if group in (getattr(f, "__defaults__", None) or ())]
    dist.all_reduce(torch.ones(4))
    dist.destroy_process_group()
    held = sys.getrefcount(group) - 2                 # minus this name and getrefcount's argument
    del group
    # the store's thread ends on its own a moment after the store is freed (seen 1 run in 4
    # still alive right after): wait for it, a while — a group still held keeps it for good
    import time
    deadline = time.monotonic() + 10
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    print(f"captured={captured} held={held} threads={before},{threads()}")
""")


@pytest.mark.parametrize("when", ["before", "after"])
def test_destroying_a_user_made_group_frees_it(when, tmp_path):
    """No function keeps the group as its default, nothing holds it once destroyed, and the
    process has the threads it had before the group."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    out = subprocess.run([sys.executable, "-c", ONE_RANK, when], env=env, cwd=tmp_path, text=True,
                         capture_output=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    t_before, t_after = line.split("threads=")[1].split(",")
    assert "captured=[] held=0 " in line and t_before == t_after, line
