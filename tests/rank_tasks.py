"""Small rank-side tasks the tests run on warm pools (importable by the rank processes)."""
import contextlib
import os
import time

import torch

from minishard.core.comm import Comm, bytes_written


def collective_bytes(rank, numel: int, ops=("all_reduce", "all_gather", "reduce_scatter", "broadcast")):
    """For each op: the wire bytes comm recorded, and the bytes the OS saw this process write."""
    comm = Comm(rank.tracer)
    N = comm.world_size
    out = {}
    for op in ops:
        n = numel - numel % N if op == "reduce_scatter" else numel
        x = torch.arange(n, dtype=torch.float32) + rank.rank
        comm.barrier()
        w0, c0 = bytes_written(), comm.totals["wire"]
        if op == "all_reduce":
            comm.all_reduce(x)
        elif op == "all_gather":
            comm.all_gather(torch.empty(n * N), x)
        elif op == "reduce_scatter":
            comm.reduce_scatter(torch.empty(n // N), x)
        elif op == "broadcast":
            comm.broadcast(x, 0)
        out[op] = {"recorded": comm.totals["wire"] - c0, "os": bytes_written() - w0,
                   "bytes": n * 4 * (N if op == "all_gather" else 1)}
    return out


def collective_results(rank, numel: int, async_op: bool = False):
    """The values each collective produces, to check them against local arithmetic."""
    comm = Comm(rank.tracer)
    N, r = comm.world_size, rank.rank
    n = numel - numel % N
    base = torch.arange(n, dtype=torch.float32)
    rs_out = torch.empty(n // N)
    ag_out = torch.empty(n * N)
    ar = base * (r + 1)
    works = [comm.reduce_scatter(rs_out, base * (r + 1), async_op=async_op),
             comm.all_gather(ag_out, base + r, async_op=async_op),
             comm.all_reduce(ar, async_op=async_op)]
    for w in works:
        if w is not None:
            w.wait()
    return {"rs": rs_out, "ag": ag_out, "ar": ar}


def completion_stamps(rank, numel: int = 4096, pause: float = 1.0):
    """Async collectives under a tracer, waited for only after a pause: each event's end time is
    when the collective completed (before the wait), and waiting leaves no helper thread alive."""
    import threading
    comm = Comm(rank.tracer)
    N = comm.world_size
    comm.barrier()                # both ranks issue the collectives at about the same moment
    works = [comm.all_gather(torch.empty(numel * N), torch.ones(numel), async_op=True),
             comm.all_reduce(torch.ones(numel), async_op=True),
             comm.reduce_scatter(torch.empty(numel), torch.ones(numel * N), async_op=True)]
    time.sleep(pause)
    waited_at = rank.tracer.now()
    for w in works:
        w.wait()
    return {"waited_at": waited_at,
            "helpers": [t.name for t in threading.enumerate() if t.name.startswith("minishard")]}


def raise_on(rank, bad_rank: int, delay: float = 0.0):
    """Rank ``bad_rank`` raises; the others block in a collective, as in a real failure."""
    comm = Comm(rank.tracer)
    if rank.rank == bad_rank:
        time.sleep(delay)
        raise ValueError(f"boom on rank {bad_rank}")
    comm.all_reduce(torch.ones(4))
    return rank.rank


def sleep(rank, seconds: float):
    time.sleep(seconds)
    return os.getpid()


def report_three(rank):
    """Hands the caller three numbers while it runs, then returns."""
    for k in range(3):
        rank.report(10 * rank.rank + k)
    return rank.rank


def whoami(rank):
    return {"rank": rank.rank, "world_size": rank.world_size, "pid": os.getpid()}


def backward_overlap(rank, strategy: str):
    """Which collectives ran while backward was still running."""
    from minishard.training.loop import TrainConfig, train
    train(rank, TrainConfig(strategy=strategy, steps=1, model="nano", micro_batch=1, bucket_cap_mb=0.2, track_activations=False))
    evs = rank.tracer.events
    end = next(e["t"] for e in evs if e["kind"] == "phase" and e["name"] == "backward"
               and e["edge"] == "end")
    return [(e["op"], e["tag"], e["t"] < end) for e in evs if e["kind"] == "collective"]


def fsdp_lifecycle(rank, layout: str = "per_param"):
    """One FSDP step of the 3-block nano GPT: the unit state changes and the collectives, in the
    order they were issued (read with the chapter's own reader, so the test checks what it shows)."""
    from minishard.course.ch06 import lifecycle_order
    from minishard.training.loop import TrainConfig, train
    train(rank, TrainConfig(strategy="fsdp" if layout == "per_param" else "fsdp_flat", steps=1,
                            model="nano", micro_batch=1, track_activations=False))
    return lifecycle_order(rank.tracer.events, rank=rank.rank)


def fsdp_manual_vs_hooks(rank, steps: int = 2):
    """The same training, once driven by hooks and once by hand (course.ch06.manual_step)."""
    from minishard.strategies import fsdp
    from minishard.core.comm import Comm
    from minishard.course.ch06 import manual_step
    from minishard.core.model import GPT, batch, config

    cfg = config("nano")
    comm = Comm(rank.tracer)
    results = []
    for manual in (False, True):
        net = GPT(cfg)
        fsdp.apply_fsdp(net, comm=comm, manual=manual)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        losses = []
        for s in range(steps):
            x, y = batch(cfg, s, 2, rank.rank, rank.world_size)
            if manual:
                loss = manual_step(net, x, y)
            else:
                loss = net(x, y)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            losses.append(loss.item())
        results.append((losses, fsdp.full_parameters(net)))
    (l1, p1), (l2, p2) = results
    return l1 == l2 and all(torch.equal(p1[k], p2[k]) for k in p1)


def fsdp_forward_order(rank, prefetch: int):
    """Unit state changes during the first forward of an FSDP step with prefetch."""
    from minishard.training.loop import TrainConfig, train
    train(rank, TrainConfig(strategy="fsdp", steps=1, model="nano", micro_batch=1, prefetch=prefetch, track_activations=False))
    evs = rank.tracer.events
    end = next(i for i, e in enumerate(evs) if e["kind"] == "phase" and e["name"] == "forward"
               and e["edge"] == "end")
    return [f"{e['name']}:{e['state']}" for e in evs[:end] if e["kind"] == "unit"]


class _Buffers:
    """A stand-in ledger that keeps the comm_buffers a collective allocates."""
    def __init__(self):
        self.allocated = []

    def alloc(self, category, nbytes, tag):
        self.allocated.append((category, nbytes))

    def free(self, tag):
        pass


def reduce_scatter_in_place_and_buffers(rank, numel: int):
    """Out of place and in place (the output is this rank's block of the input, as ZeRO-1 calls
    it): the values, and the receive buffers the reduce-scatter allocated for each."""
    out = {}
    for in_place in (False, True):
        buffers = _Buffers()
        comm = Comm(rank.tracer, ledger=buffers)
        N, r = comm.world_size, comm.rank
        x = torch.arange(numel - numel % N, dtype=torch.float32) * (r + 1)
        y = x.view(N, -1)[r] if in_place else torch.empty(x.numel() // N)
        comm.reduce_scatter(y, x)
        out["in_place" if in_place else "out_of_place"] = {"slice": y.clone(), "buffers": buffers.allocated}
    return out


# ---- property tests (tests/test_properties.py): batches of random collectives

def prop_values(seed: int, rank: int, numel: int, dtype: str) -> torch.Tensor:
    """Rank ``rank``'s values for a property case: random floats of very different magnitudes
    (2^-20 .. 2^20), so that adding them in another order changes the float32 sum. The test
    process makes the same values for its reference."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-20, 21, (numel,), generator=g).double())
    if dtype == "uint8":
        return torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8)
    return x.to(getattr(torch, dtype))


def prop_collectives(rank, cases: list, newest_first: bool = False):
    """Run a batch of all-gathers and reduce-scatters, each case a dict (op, n, dtype, async,
    in_place, seed); asynchronous ones are waited for after the whole batch was issued (several
    in flight at once, as FSDP's prefetch and ZeRO's buckets do), in issue order or
    ``newest_first``. Returns, per case, the output and the input after the collective."""
    comm = Comm(rank.tracer)
    N, r = comm.world_size, comm.rank
    pending, out = [], []
    for case in cases:
        n, dtype = case["n"], getattr(torch, case["dtype"])
        if case["op"] == "all_gather":
            output = torch.full((N * n,), 77, dtype=dtype) if dtype == torch.uint8 else \
                torch.full((N * n,), float("nan"), dtype=dtype)
            if case["in_place"]:     # as FSDP and ZeRO call it: the input is our block of the output
                inp = output.view(N, -1)[r]
                inp.copy_(prop_values(case["seed"], r, n, case["dtype"]))
            else:
                inp = prop_values(case["seed"], r, n, case["dtype"])
            w = comm.all_gather(output, inp, async_op=case["async"])
        else:
            inp = prop_values(case["seed"], r, N * n, case["dtype"])
            if case["in_place"]:     # as ZeRO-1 calls it: the output is our block of the input
                output = inp.view(N, -1)[r]
            else:
                output = torch.full((n,), float("nan"), dtype=dtype)
            w = comm.reduce_scatter(output, inp, async_op=case["async"])
        out.append({"output": output, "input": inp})
        if w is not None:
            pending.append(w)
    for w in (reversed(pending) if newest_first else pending):    # every exchange is posted
        w.wait()
    return [{"output": o["output"].clone(), "input": o["input"].clone()} for o in out]


def one_rank_in_a_collective(rank, waiter: int = 0):
    """Rank ``waiter`` all-reduces; the others never join (they return at once and stay up):
    the collective can end only by the process group's timeout."""
    if rank.rank == waiter:
        Comm(rank.tracer).all_reduce(torch.ones(4))
    return rank.rank


def live_private_attributes(rank, names: list[str]) -> dict[str, bool]:
    """For each ``module.Class#attribute`` the adapters list: whether a live object of that class
    has the attribute (what torch sets in ``__init__`` is not on the class). The objects: a
    two-layer model under FSDP2's ``fully_shard`` and one under DDP, on these ranks."""
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(net[0])
    fully_shard(net)
    state = net._get_fsdp_state()
    live = {"FSDPState": state, "FSDPParamGroup": state._fsdp_param_group or
            net[0]._get_fsdp_state()._fsdp_param_group,
            "DistributedDataParallel": DistributedDataParallel(nn.Linear(4, 4))}
    out = {}
    for name in names:
        path, _, attribute = name.partition("#")
        obj = live[path.rsplit(".", 1)[1]]
        out[name] = hasattr(obj, attribute)
    return out


def _build_toy(strategy, net, config, comm, ledger):
    """A strategy written outside minishard: minishard's DDP over a plain torch optimizer, as a
    ``Built`` that answers one question of its own (how to accumulate) and inherits the rest."""
    from minishard.strategies.ddp import DDP
    from minishard.strategies.registry import Built, optimizer_spec

    class ToyBuilt(Built):
        def accumulating(self, quiet):
            return self.model.no_sync() if quiet else contextlib.nullcontext()

        def _parameters(self):
            return dict(net.named_parameters())
    model = DDP(net, comm=comm, ledger=ledger, bucket_cap_mb=config.bucket_cap_mb)
    opt_class, kwargs = optimizer_spec(config.optimizer, config.lr)
    return ToyBuilt(strategy, model, opt_class(net.parameters(), **kwargs), (comm,))


def a_toy_strategy_trains(rank) -> dict:
    """Register a strategy with one registry entry (here, on this rank, for this task only) and
    train with it, then with ``ddp`` from the same start: nothing else had to know of it."""
    from minishard.strategies import registry
    from minishard.training.loop import TrainConfig, train
    toy = registry.Strategy("toy_ddp", "a toy DDP", 0, _build_toy, buckets=True)
    registry.STRATEGIES[toy.name] = toy
    try:
        knobs = dict(model="nano", steps=2, micro_batch=2, rank_seeds=True, return_params=True,
                     bucket_cap_mb=0.05)
        config = TrainConfig(strategy="toy_ddp", **knobs)
        ours = train(rank, config)
        unused = TrainConfig(strategy="toy_ddp", wrap="linear", **knobs).unused()
    finally:
        del registry.STRATEGIES[toy.name]
    ddp = train(rank, TrainConfig(strategy="ddp", **knobs))
    return {"strategy": ours["strategy"], "losses": (ours["losses"], ddp["losses"]),
            "equal": all(torch.equal(ours["params"][n], ddp["params"][n]) for n in ddp["params"]),
            "unused": unused, "calls": sum(ours["calls"])}


def companions(rank) -> dict:
    """A communicator's companion: its ranks in a group of their own, made once per name (a
    background save's exchange runs there, never in the training's group)."""
    import torch.distributed as dist
    comm = Comm(rank.tracer)
    first, again, other = comm.companion("checkpoint"), comm.companion("checkpoint"), comm.companion("x")
    x = torch.ones(2) * (rank.rank + 1)
    comm.all_reduce(torch.ones(1), tag="world")
    first.all_reduce(x, tag="companion")
    return {"same": first is again, "own_group": first.group is not comm.group and other.group is not first.group,
            "rank": first.rank == comm.rank, "ranks": dist.get_process_group_ranks(first.group),
            "sum": x.tolist(), "name": first.name, "entries": [(e["group"], e["seq"]) for e in comm.flight.entries]}


def companion_timeouts(rank) -> dict:
    """The collective timeout of a communicator's group and of its companion's."""
    from minishard.core.c10d import group_timeout
    comm = Comm(rank.tracer)
    mate = comm.companion("checkpoint")
    return {"world": group_timeout(comm.group), "companion": group_timeout(mate.group)}
