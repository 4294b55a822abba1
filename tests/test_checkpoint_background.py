"""Background checkpoints (``checkpoint.save(..., background=True)``): the file equals a
synchronous save's byte for byte although training changed every value before it was written;
the save returns before its write and the next save waits for it; a run ends with its last
checkpoint on disk, each save in the trace; an error on one rank is raised by every rank's
wait. (A rank killed during the background write: ``test_checkpoint.py``'s kill test.)"""
import os
from pathlib import Path

import pytest
import torch

from minishard import checkpoint
from minishard.core.comm import Comm
from minishard.viewers import offline_player
from minishard.cli import main
from minishard.core.trace import write_dir
from minishard.training.loop import TrainConfig, train

import checkpoint_tasks

RUNS = {2: [("n2_fsdp", "fsdp"), ("n2_zero1", "zero1")], 3: [("n3_fsdp", "fsdp"), ("n3_zero2", "zero2")]}


def _files(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(d.iterdir())}


@pytest.mark.parametrize("N", sorted(RUNS))
def test_a_background_save_holds_the_values_at_the_call_bit_for_bit(pools, tmp_path, N):
    results = pools(N).run(checkpoint_tasks.background_runs, str(tmp_path), RUNS[N])
    for k, (name, _) in enumerate(RUNS[N]):
        per_rank = [r[k] for r in results]
        # training took a step and every saved value changed before the write: the files are
        # still the synchronous save's, made just before, byte for byte (metadata included)
        assert _files(tmp_path / f"{name}_bg") == _files(tmp_path / f"{name}_sync"), name
        assert all(r["returned_first"] for r in per_rank), name      # save returned, then wrote
        assert all(r["load_equal"] for r in per_rank), name
        for r in per_rank:                # the host copy: every byte of the rank's pieces, once
            assert 0 < r["host_copy_bytes"] < r["bytes_written"] and r["sync_host_copy_bytes"] == 0
    assert all(r[0]["second_waited"] for r in results)          # the next save waited for it


@pytest.mark.parametrize("every, saved", [(1, [1, 2, 3]), (2, [2, 3])])
def test_a_run_ends_with_its_last_checkpoint_on_disk_and_each_save_in_the_trace(pools, tmp_path, every, saved):
    """Saved after every ``every``-th step and after the last (3 of 3 although 3 % 2 != 0); in
    the trace each write after its copy, lasting no longer than until the next save waited."""
    ck = tmp_path / "run"
    steps = 3
    results = pools(2).run(checkpoint_tasks.train_saving_in_background, str(ck), steps, every)
    for r in results:
        assert r["on_disk"] == steps and not r["leftover"]
        assert [s for s, _ in r["stalls"]] == saved
    events = pools(2).last_events
    for rank in (0, 1):
        mine = [e for e in events if e["rank"] == rank]
        copies = [e for e in mine if e["kind"] == "phase" and e["name"] == "checkpoint_copy"
                  and e["edge"] == "begin"]
        writes = [e for e in mine if e["kind"] == "transfer" and e.get("tag") == "checkpoint_write"]
        assert [e["step"] for e in copies] == [s - 1 for s in saved]     # the step each one saved
        assert len(writes) == len(saved) and all(e["direction"] == "to_disk" and e["bytes"] > 0
                                                 and e["seconds"] >= 0.2 for e in writes)
        assert all(c["t"] < w["t"] for c, w in zip(copies, writes))      # each write after its copy
        # a save waits for the write before it, then copies: each write ended before the next copy
        assert all(w["t"] + w["seconds"] <= c["t"] for w, c in zip(writes, copies[1:]))
        assert [w["step"] for w in writes] == [c["step"] for c in copies]   # of the save that made it
    write_dir(events, tmp_path / "trace")             # the viewer's timeline draws both
    assert main(["view", str(tmp_path / "trace"), "-o", str(tmp_path / "p.html")]) == 0
    spans = offline_player.encode(tmp_path / "trace")["span_names"]
    assert "checkpoint_copy" in spans and "transfer to_disk" in spans


def test_an_error_on_one_rank_is_raised_by_every_ranks_wait(pools, tmp_path):
    ck = tmp_path / "ck"
    results = pools(2).run(checkpoint_tasks.background_fails, str(ck), 1)
    assert [r["raised"] for r in results] == ["planted failure on rank 1"] * 2
    assert all(r["after_failure"] == 2 and r["again"] == 4 for r in results)
    assert checkpoint.read_metadata(ck)["step"] == 4 and not (tmp_path / ".ck.saving").exists()
    assert checkpoint.read_full(ck)           # every file there, every checksum right


def test_in_one_process_the_copy_is_what_is_written(tmp_path):
    net, opt = checkpoint_tasks.one_process_model()
    comm = Comm(alone=True)
    checkpoint.save(net, opt, tmp_path / "sync", step=1)
    with pytest.raises(ValueError, match=r"background=True\) needs comm=: the run's communicator keeps"):
        checkpoint.save(net, opt, tmp_path / "bg", step=1, background=True)
    with checkpoint_tasks.held_writes() as gate:
        pending = checkpoint.save(net, opt, tmp_path / "bg", comm=comm, step=1, background=True)
        assert comm.in_flight == [pending]
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(-1.0)
        assert not pending.done()
        gate.set()
        assert pending.wait()["stall_seconds"] <= pending.wait()["seconds"]
    assert checkpoint.wait_for_saves(comm) == [] and comm.in_flight == []
    assert _files(tmp_path / "bg") == _files(tmp_path / "sync")
    with pytest.raises(TypeError, match="background must be True or False"):
        checkpoint.save(net, opt, tmp_path / "x", comm=comm, step=1, background="yes")


@pytest.mark.parametrize("argv, words", [
    (["--save-background"], ["--save-background needs --save"]),
    (["--save-every", "2"], ["--save-every 2 needs --save"]),
    (["--save", "{tmp}/ck", "--save-every", "0"], ["--save-every 0", "integer >= 1"]),
])
def test_bad_save_flags_are_named(argv, words, tmp_path, capsys):
    assert main(["demo", *[a.format(tmp=tmp_path) for a in argv]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    with pytest.raises(ValueError, match="save_every=0"):
        TrainConfig(save_to=str(tmp_path), save_every=0)
    assert not os.path.exists(tmp_path / "ck")


SCRIPT_THAT_DOES_NOT_WAIT = """
import sys, torch
from minishard import checkpoint
from minishard.core.comm import Comm
from minishard.core.model import GPT
net = GPT("nano")
pending = checkpoint.save(net, torch.optim.AdamW(net.parameters()), sys.argv[1], comm=Comm(alone=True),
                          step=7, background=True)
print("returned before the write:", not pending.done())
"""


def test_a_script_that_ends_without_waiting_still_leaves_its_checkpoint(tmp_path):
    """The writer is an ordinary thread, not a daemon: an interpreter that ends waits for it."""
    import subprocess
    import sys
    script = tmp_path / "no_wait.py"
    script.write_text(SCRIPT_THAT_DOES_NOT_WAIT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert checkpoint.read_metadata(tmp_path / "ck")["step"] == 7
    assert not (tmp_path / ".ck.saving").exists()


def test_the_full_state_on_rank0_is_the_checkpoint_and_costs_what_the_formula_says(pools, tmp_path):
    """Chapter 09 §8: the memory of three ways to save the same FSDP state, in bytes of the
    tensors each allocates — sharded: none (the file is written from the live shards); in the
    background: the rank's share 12Ψ/N (its host copy); the full state: 12Ψ on rank 0, sent by
    the others from their shards — and the gathered state equals the sharded checkpoint."""
    from minishard.core.model import GPT
    from minishard.course import ch09
    out = pools(2).run(ch09.save_peaks, str(tmp_path), model="nano")
    state = 12 * GPT("nano", device="meta").num_params()
    for o in out:
        assert o["held"] == state // 2 and o["sharded"] == 0 and o["background"] == state // 2
    assert out[0]["full"] == state and out[0]["full_equals_checkpoint"] and out[0]["sent"] == 0
    assert out[1]["full"] == 0 and out[1]["sent"] == state // 2


def test_the_three_saves_stall_and_write_side_by_side(pools, tmp_path):
    """Chapter 09 §8: each save timed on every rank (stall <= visible, stall <= written), and the
    last round's checkpoints all on disk: the background save's files are the synchronous
    save's byte for byte (nothing trained between them), DCP's has its metadata."""
    from minishard.course import ch09
    out = pools(2).run(ch09.save_stalls, str(tmp_path), 2, model="nano")
    for o in out:                             # two rounds: the second one's order rotated
        assert len(o["rounds"]) == 2 and all(sorted(r) == sorted(ch09.SAVES) for r in o["rounds"])
        for name, m in [(n, m) for r in o["rounds"] for n, m in r.items()]:
            assert 0 < m["stall"] <= m["written"] and m["slowed"] >= 0, (name, m)
            assert m["visible"] == pytest.approx(m["stall"] + m["slowed"]), (name, m)
        for r in o["rounds"]:                 # nothing runs beside a synchronous save: it slows
            sync = r["synchronous"]           # nothing (its slowed time is the loop's, not its call's)
            assert sync["slowed"] < sync["stall"], sync
    for name in ch09.SAVES:                   # one round of the slowest rank: its columns add up
        row = ch09.median_round(out, name)
        rounds = [max((o["rounds"][k][name] for o in out), key=lambda m: m["visible"]) for k in range(2)]
        assert row in rounds and row["visible"] == row["stall"] + row["slowed"], (name, row)
        assert row == sorted(rounds, key=lambda m: m["visible"])[1], (name, row, rounds)
    last = Path(out[0]["last"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [last.name]        # earlier rounds removed
    assert _files(last / "background") == _files(last / "synchronous")
    assert (last / "dcp_async" / ".metadata").exists()


def full_state_of(rank, root: str, strategy: str, model: str = "nano") -> dict:
    """Rank task: one step of ``strategy``, a sharded checkpoint, then chapter 09's full state
    gathered on rank 0 — what each rank sent, and (rank 0) whether it equals the checkpoint."""
    from minishard.core.model import GPT, batch, config
    from minishard.course import ch09
    from minishard.strategies.registry import build
    from minishard.training.step import train_step
    comm, cfg = Comm(rank.tracer), config(model)
    built = build(GPT(cfg, seed=0), TrainConfig(strategy, model=model), comm)
    train_step(built, [batch(cfg, 0, 2, comm.rank, comm.world_size)])
    checkpoint.save(built.model, built.optimizer, Path(root) / strategy, comm=comm, step=1)
    full, measured = ch09.full_state_on_rank0(built.model, built.optimizer, comm)
    out = {"rank": comm.rank, "sent": measured["sent"], "peak": measured["peak"]}
    if comm.rank == 0:
        saved = checkpoint.read_full(Path(root) / strategy)
        out["equal"] = sorted(saved) == sorted(full) and all(
            torch.equal(full[n], saved[n].reshape(-1)) for n in full)
    return out


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_the_full_state_on_rank0_receives_a_replica_once(pools, tmp_path, strategy):
    """Chapter 09 §8 under replicas (DDP's every tensor, ZeRO-1's parameters): each rank sends
    its chunk of a replica once, as the sharded save writes it — rank 1 of 2 sends half the
    state, not its whole replica again — and rank 0's gathered state is the checkpoint."""
    from minishard.core.model import GPT
    out = pools(2).run(full_state_of, str(tmp_path), strategy)
    state = 12 * GPT("nano", device="meta").num_params()
    assert out[0]["equal"] and out[0]["sent"] == 0 and out[0]["peak"] == state
    assert out[1]["sent"] == state // 2, (out[1]["sent"], state)


def test_a_rank_killed_inside_a_background_write_leaves_the_last_checkpoint_loadable(tmp_path):
    """Chapter 09 §8's kill, on real ranks: rank 1 dies (SIGKILL) with 1,000 bytes of its file
    written. The dead save stays under ``.NAME.saving`` without ``metadata.json``; the checkpoint
    under its name is step 2's and loads on one process, every block verified; the next save
    clears the dead one away."""
    from minishard import GPT, RankError, Ranks
    from minishard.course.ch09 import killed_mid_write
    path = tmp_path / "killed"
    with pytest.raises(RankError):                # (rank 0 may report first: its peer vanished)
        with Ranks(2, timeout=120) as own:
            own.run(killed_mid_write, str(path), 1, model="nano")
    saving = tmp_path / ".killed.saving"
    assert (saving / "rank1.safetensors").stat().st_size == 1000
    assert not (saving / "metadata.json").exists()
    net = GPT("nano", seed=7)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    info = checkpoint.load(net, opt, path, comm=Comm())
    assert (info["step"], info["saved_world_size"]) == (2, 2)
    checkpoint.save(net, opt, path, comm=Comm(), step=3)
    assert not saving.exists() and checkpoint.load(net, opt, path, comm=Comm())["step"] == 3
