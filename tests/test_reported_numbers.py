"""Every number the doctor and the watch report, checked against an independent count (issue 39).

Each test computes the quantity a report prints from the tensors themselves — numel times
element size of the real parameters, gradients, optimizer state and collective buffers, a count
of the elements an update left unchanged, the bytes of the allocations in a trace — and compares
it with the number the report prints or returns. The instruments:

    health   a step's note: how many low-precision elements the optimizer stepped, how many
             came out unchanged (the doctor's precision finding prints both, and their share);
             the weights finding's count of parameters that differ, and their fingerprints
    causes   the out-of-memory split: the bytes of each cause, their order, and the first fix —
             the one that shrinks the largest cause (synthetic traces where each cause in turn
             dominates; one real run where the units gathered are real FSDP units)
    watch    the memory categories it gives FSDP2's buffers on a real 2-rank FSDP2 job: the
             gathered parameters, the all-gather and reduce-scatter buffers, the sharded
             gradients, Adam's moments, and the payload of each collective
    doctor   the bytes it prints for a collective: minishard's own flight dumps from real ranks,
             the last collective a trace holds, and PyTorch's own flight-recorder dumps
    meter    what a run reports per step and per collective: the training traffic only (not the
             set-up's broadcast), and each step's own exposed seconds (not the running total)
"""
import copy
import hashlib
import json
import pickle
from collections import Counter, defaultdict

import pytest
import torch
import torch.distributed as dist

import minishard
from minishard.instruments import causes, doctor, health
from minishard.core.comm import Comm
from minishard.core.trace import SCHEMA_VERSION
from minishard.viewers.playback import fmt_bytes

MiB = 2 ** 20


# =========================================================================== health

def test_a_step_note_counts_the_low_precision_elements_and_the_updates_rounded_away():
    """bf16 weights at 1.0 stepped by SGD (lr 1): an update under half of bf16's spacing at 1.0
    (2**-7) is lost, one of 0.25 is not, a zero gradient changes nothing. The note's counts and
    the doctor's line about them are the counts made here, element by element."""
    w16 = torch.nn.Parameter(torch.ones(4, 8, dtype=torch.bfloat16))
    b16 = torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16))
    w32 = torch.nn.Parameter(torch.ones(6, 7))                     # fp32: not low precision
    w16.grad = torch.full_like(w16, 0.25)
    w16.grad[0, :3] = 1e-4                                         # 3 updates rounded away
    b16.grad = torch.zeros_like(b16)
    b16.grad[:2] = 0.25                                            # 3 elements with no update
    w32.grad = torch.full_like(w32, 1e-4)
    opt = torch.optim.SGD([w16, b16, w32], lr=1.0)
    with health.StepNotes(opt) as notes:
        opt.step()
    low = w16.numel() + b16.numel()
    unchanged = int((w16 == 1).sum() + (b16 == 1).sum())           # every weight started at 1.0
    assert (low, unchanged) == (37, 6)                             # (the case is what it says)
    assert notes.note == {"param_dtypes": ["bfloat16", "float32"], "low_precision_elements": low,
                          "unchanged": unchanged}
    dumps = {0: {"entries": [], "facts": {"steps": [{"step": 0, **notes.note}]}}}
    (f,) = causes.precision(dumps)
    assert f.evidence == [f"rank 0, step 0: {unchanged:,} of {low:,} bfloat16 elements the optimizer "
                          f"stepped came out unchanged ({100 * unchanged / low:.1f} %)"]


def _blake(t: torch.Tensor) -> str:
    """A tensor's fingerprint as health.py defines it: BLAKE2 (8 bytes) of dtype, shape, bytes."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode() + t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_the_weights_finding_counts_the_parameters_that_differ_and_quotes_their_fingerprints():
    """Four DDP replicas of GPT("nano"): rank 1 has two parameters nudged, rank 3 one, rank 2
    none. Each rank's count of parameters that differ, the number of parameters in all, the first
    one named and both fingerprints quoted, are counted and hashed here from the models."""
    torch.manual_seed(0)
    base = minishard.GPT("nano")
    models = [base] + [copy.deepcopy(base) for _ in range(3)]
    names = [n for n, _ in models[0].named_parameters()]
    nudged = {1: [names[17], names[5]], 3: [names[30]]}
    for r, which in nudged.items():
        params = dict(models[r].named_parameters())
        with torch.no_grad():
            for n in which:
                params[n].view(-1)[0] += 1e-3
    dumps = {r: {"entries": [], "facts": {"weights_start": health.fingerprint(m.named_parameters())}}
             for r, m in enumerate(models)}
    (f,) = causes.weights(dumps)
    assert (f.kind, f.ranks) == ("weights", [1, 3])
    for line, (r, which) in zip(f.evidence, sorted(nudged.items())):
        first = min(which, key=names.index)                        # in the model's order
        mine, theirs = (dict(m.named_parameters())[first] for m in (models[r], base))
        assert line == (f"rank {r}: {len(which)} of {len(names)} parameters differ from rank 0's at the "
                        f"first step (first: {first}, fingerprint {_blake(mine)} against {_blake(theirs)})")


def test_the_weights_are_compared_within_each_group_that_must_start_alike():
    """DDP on two pairs of four ranks (each rank notes its pair as ``weights_start_ranks``): the
    pairs hold other models by design (another model on ranks 2, 3: tensor or pipeline
    parallelism beside DDP), so rank 2 is compared with no one but rank 3. Rank 1 nudged in one
    parameter differs from rank 0, rank 3 in two from rank 2 — each counted against its own
    pair's lowest rank; nudged nowhere, nothing is found."""
    torch.manual_seed(0)
    first, other = minishard.GPT("nano", seed=0), minishard.GPT("nano", seed=1)
    models = [first, copy.deepcopy(first), other, copy.deepcopy(other)]
    names = [n for n, _ in first.named_parameters()]

    def dumps():
        return {r: {"entries": [], "facts": {"weights_start": health.fingerprint(m.named_parameters()),
                                             "weights_start_ranks": [r // 2 * 2, r // 2 * 2 + 1]}}
                for r, m in enumerate(models)}
    assert causes.weights(dumps()) == []
    nudged = {1: [names[5]], 3: [names[17], names[30]]}
    for r, which in nudged.items():
        params = dict(models[r].named_parameters())
        with torch.no_grad():
            for n in which:
                params[n].view(-1)[0] += 1e-3
    (f,) = causes.weights(dumps())
    assert (f.kind, f.ranks) == ("weights", [1, 3])
    assert f.title.startswith("ranks 1, 3 started training from other weights than the lowest rank of "
                              "their replica group (ranks 0, 2)"), f.title
    for line, (r, which) in zip(f.evidence, sorted(nudged.items())):
        base = r // 2 * 2
        mine, theirs = (dict(models[x].named_parameters())[which[0]] for x in (r, base))
        assert line == (f"rank {r}: {len(which)} of {len(names)} parameters differ from rank {base}'s at "
                        f"the first step (first: {which[0]}, fingerprint {_blake(mine)} against "
                        f"{_blake(theirs)})")
    # the same dumps without the groups (a watch before they were noted): one world, as before
    plain = {r: {"entries": [], "facts": {"weights_start": d["facts"]["weights_start"]}}
             for r, d in dumps().items()}
    (f,) = causes.weights(plain)
    assert f.ranks == [1, 2, 3] and "than rank 0" in f.title, f.title


# =========================================================================== causes: out of memory

# the first fix each cause advises, by a phrase of its own
FIX = {"activations": "activation checkpointing", "state": "the next ZeRO stage",
       "gathered": "wrap each block", "full": "reduce-scatter every micro-batch",
       "comm": "smaller buckets"}


def _oom_events(spec: dict) -> list[dict]:
    """A rank's ledger as minishard's FSDP writes it: shards, their gradients, Adam's moments,
    units gathered (each in two tensors; another unit gathered and freed before) and the copies
    units kept after forward (``reshard_after_forward=k``: ``{unit}:post_forward``), full
    gradients of one unit (two tensors), an all-gather buffer, activations (one saved and freed
    before)."""
    ev = []

    def alloc(cat, tag, nbytes, kind="alloc"):
        if nbytes:
            ev.append({"kind": kind, "category": cat, "tag": tag, "bytes": int(nbytes),
                       "device": "device"})

    for i, cat in enumerate(("params", "grads", "exp_avg", "exp_avg_sq")):
        alloc(cat, f"root:{cat}{i}", spec["state"] / 4)
    ev.append({"kind": "phase", "name": "forward", "edge": "begin"})
    alloc("unsharded", "blocks.2:full0", 7 * MiB)                  # gathered, then resharded
    alloc("activations", "act0", 5 * MiB)
    alloc("activations", "act0", 5 * MiB, "free")
    alloc("unsharded", "blocks.2:full0", 7 * MiB, "free")
    if spec.get("post_forward"):
        ev.append({"kind": "phase", "name": "backward", "edge": "begin"})
    for unit, nbytes in spec.get("post_forward", {}).items():
        alloc("unsharded", f"{unit}:post_forward", nbytes)
    for unit, nbytes in spec["units"].items():
        alloc("unsharded", f"{unit}:full0", nbytes * 3 / 4)
        alloc("unsharded", f"{unit}:full1", nbytes / 4)
    alloc("grads", "blocks.0:grad_full0", spec["full"] / 2)
    alloc("grads", "blocks.0:grad_full1", spec["full"] / 2)
    alloc("comm_buffers", "blocks.1:ag", spec["comm"])
    alloc("activations", "act1", spec["activations"])
    for i, e in enumerate(ev):           # what every event of a trace file carries
        e.update(v=SCHEMA_VERSION, rank=0, seq=i, t=i * 1e-3)
    return ev


def _held(events: list[dict]) -> dict[str, int]:
    """What the ledger holds after ``events``, by category, counted here."""
    held = Counter()
    for e in events:
        if e["kind"] in ("alloc", "free"):
            held[e["category"]] += e["bytes"] if e["kind"] == "alloc" else -e["bytes"]
    return {c: b for c, b in held.items() if b}


SPLITS = {   # case -> the largest cause, and the bytes of each (MiB): in each case another dominates
    "activations": ("activations", dict(activations=9, state=4, units={"blocks.0": 2, "root": 1}, full=0, comm=0.5)),
    "state": ("state", dict(activations=2, state=16, units={"blocks.0": 3, "root": 1}, full=0, comm=1)),
    "gathered": ("gathered", dict(activations=2, state=4, units={"blocks.0": 6, "root": 5}, full=1, comm=1)),
    "full": ("full", dict(activations=2, state=4, units={"blocks.0": 1}, full=12, comm=1)),
    "comm": ("comm", dict(activations=2, state=4, units={"blocks.0": 1, "root": 2}, full=1, comm=10)),
    # in backward, with reshard_after_forward=k: the units' post-forward copies are gathered bytes
    "kept_after_forward": ("gathered", dict(activations=2, state=4, units={"blocks.0": 1},
                                            post_forward={"blocks.1": 3, "blocks.2": 2.5}, full=0, comm=1)),
}


@pytest.mark.parametrize("case", list(SPLITS))
def test_the_out_of_memory_split_counts_each_cause_and_advises_the_largest_first(tmp_path, case):
    """Each cause's bytes are those its allocations still hold (counted here from the events),
    the causes come largest first, their bytes add up to what the rank held, and the first fix
    is the largest cause's."""
    largest, spec = SPLITS[case]
    spec = {k: ({u: b * MiB for u, b in v.items()} if isinstance(v, dict) else v * MiB)
            for k, v in spec.items()}
    events = _oom_events(spec)
    held = _held(events)
    (tmp_path / "rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    oom = {"category": "activations", "tag": "act2", "nbytes": MiB, "budget": sum(held.values()),
           "held": held}
    (tmp_path / "flight_rank0.json").write_text(json.dumps(
        {"v": 1, "rank": 0, "world_size": 1, "reason": "exception", "error": "DeviceOutOfMemory: x",
         "entries": [], "facts": {"out_of_memory": oom}}))
    (f,) = [f for f in doctor.diagnose(tmp_path).findings if "ran out of memory" in f.title]

    state = sum(held.get(c, 0) for c in ("params", "grads", "exp_avg", "exp_avg_sq")) - spec["full"]
    units = {u: sum(e["bytes"] * (1 if e["kind"] == "alloc" else -1) for e in events
                    if e.get("tag", "").startswith((f"{u}:full", f"{u}:post_forward")))
             for u in [*spec["units"], *spec.get("post_forward", {})]}
    want = {"activations": held["activations"], "state": state, "gathered": sum(units.values()),
            "full": spec["full"], "comm": held["comm_buffers"]}
    said = {"activations": f"activations {fmt_bytes(want['activations'])}: ",
            "state": f"parameters' shards, gradients and optimizer state {fmt_bytes(state)}: ",
            "gathered": f"{len(units)} unit{'s' if len(units) > 1 else ''} gathered at once: " + ", ".join(
                f"{u} {fmt_bytes(b)}" for u, b in sorted(units.items(), key=lambda ub: -ub[1])),
            "full": f"full gradients {fmt_bytes(spec['full'])}: ",
            "comm": f"communication buffers {fmt_bytes(want['comm'])}: "}
    order = sorted((c for c in want if want[c]), key=lambda c: -want[c])
    assert order[0] == largest                                     # (the case is what it says)
    assert [line[:len(said[c])] for line, c in zip(f.evidence, order)] == [said[c] for c in order]
    assert len(f.evidence) == len(order)
    assert sum(want.values()) == sum(held.values())                # every byte held is in one cause
    assert f"rank 0 held {fmt_bytes(sum(held.values()))}, allocating {fmt_bytes(MiB)} of activations" \
        in f.title
    assert f.fix.startswith("change the largest first: ") and FIX[largest] in f.fix, f.fix


def test_a_real_out_of_memory_names_each_gathered_unit_with_its_parameters_bytes(tmp_path):
    """One rank of minishard's FSDP (GPT "nano", a unit per block, prefetch 2) runs out of a
    2.86 MiB device: each unit the split names gathered holds exactly its parameters' fp32
    bytes (numel x 4, from the model), the state is the shards and their gradients (one rank:
    the whole model twice), the buffer is one block's all-gather."""
    from minishard.core.launch import RankContext
    from minishard.core.ledger import DeviceOutOfMemory
    from minishard.core.trace import Tracer
    torch.manual_seed(0)
    net = minishard.GPT("nano")
    owner = {id(p): f"blocks.{i}" for i, b in enumerate(net.blocks) for p in b.parameters()}
    unit_bytes = Counter()
    for p in net.parameters():
        unit_bytes[owner.get(id(p), "root")] += p.numel() * p.element_size()
    rank = RankContext(0, 1, torch.device("cpu"), Tracer(), "none")
    with pytest.raises(DeviceOutOfMemory):
        try:
            minishard.train(rank, minishard.TrainConfig(
                strategy="fsdp", prefetch=2, device_budget=3_000_000, flight_dir=str(tmp_path),
                model="nano", steps=1, micro_batch=2))
        finally:
            rank.tracer.write_jsonl(tmp_path / "rank0.jsonl")
    (f,) = [f for f in doctor.diagnose(tmp_path).findings if "ran out of memory" in f.title]
    (line,) = [e for e in f.evidence if "gathered at once" in e]
    named = line.split(": ")[1].split(", ")
    assert len(named) >= 2, line
    for said in named:
        unit, size = said.split(" ", 1)
        assert size == fmt_bytes(unit_bytes[unit]), (said, unit_bytes)
    said = "\n".join(f.evidence)
    state = 2 * sum(unit_bytes.values())
    assert f"parameters' shards, gradients and optimizer state {fmt_bytes(state)}: " in said
    assert f"communication buffers {fmt_bytes(unit_bytes['blocks.0'])}: smaller buckets" in said


# =========================================================================== watch: FSDP2's buffers

N, STEPS = 2, 2


def fsdp2_under_watch(rank):
    """GPT("nano") under FSDP2 (a unit per block, then the root) on 2 ranks, 2 steps of AdamW
    under watch (events kept in memory). Counted from the tensors before wrapping: each unit's
    parameters as gathered (dim 0 padded to a multiple of the ranks, as FSDP2 shards) and as
    autograd's gradients; after: the local shards of the weights and of Adam's moments."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    net = minishard.GPT("nano")

    def gathered(p):
        rows = -(-p.shape[0] // N) * N
        return rows * (p.numel() // p.shape[0]) * p.element_size()

    owner = {id(p): f"blocks.{i}" for i, b in enumerate(net.blocks) for p in b.parameters()}
    full, grads = Counter(), Counter()
    for p in net.parameters():
        full[owner.get(id(p), "root")] += gathered(p)
        grads[owner.get(id(p), "root")] += p.numel() * p.element_size()
    for b in net.blocks:
        fully_shard(b)
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    cfg = minishard.model_config("nano")
    with minishard.watch(net, opt) as w:
        for step in range(STEPS):
            x, y = minishard.batch(cfg, step, 2, rank.rank, N)
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
            w.step()
    moments = Counter()
    for st in opt.state.values():
        for k in ("exp_avg", "exp_avg_sq"):
            local = st[k].to_local()
            moments[k] += local.numel() * local.element_size()
    return {"events": w.tracer.events, "full": dict(full), "grads": dict(grads),
            "moments": dict(moments), "held": w.held}


def test_the_watch_gives_fsdp2s_buffers_their_bytes_and_categories(pools):
    """Every alloc the watch enters for FSDP2, by its tag: a unit's gathered parameters and its
    all-gather output are the unit's parameters as gathered; the reduce-scatter's input the
    same (the unsharded gradients, copied in), its output 1/N of it (the sharded gradients);
    autograd's unsharded gradients each step are the unit's gradients; each all-gather and
    reduce-scatter moves the unit's gathered bytes; Adam's moments held at the end are the
    local shards' bytes."""
    res = pools(N).run(fsdp2_under_watch)
    for r in range(N):
        full, events = res[r]["full"], res[r]["events"]
        assert sorted(full) == ["blocks.0", "blocks.1", "blocks.2", "root"]
        unsharded_grads = defaultdict(int)          # (step, unit) -> bytes
        seen = Counter()
        for e in events:
            what, _, unit = e.get("tag", "").split(" ")[0].partition(":")
            if e["kind"] == "alloc" and unit in full:
                want = {"unsharded": ("unsharded", full[unit]),
                        "all_gather_out": ("comm_buffers", full[unit]),
                        "reduce_scatter_in": ("comm_buffers", full[unit]),
                        "grads": ("grads", full[unit] // N)}.get(what)
                if what == "grads_unsharded":
                    assert e["category"] == "grads"
                    unsharded_grads[e["step"], unit] += e["bytes"]
                elif want is not None:
                    assert (e["category"], e["bytes"]) == want, (r, e)
                seen[what] += 1
            if e["kind"] == "collective":
                assert e["payload"] == full[e["tag"]], (r, e)
                seen[e["op"]] += 1
        # per step: each unit gathered (each block twice: resharded after forward), reduce-scattered
        assert seen["unsharded"] == seen["all_gather"] == STEPS * 7
        assert seen["reduce_scatter_in"] == seen["grads"] == seen["reduce_scatter"] == STEPS * 4
        assert unsharded_grads == {(s, u): b for s in range(STEPS) for u, b in res[r]["grads"].items()}
        held = res[r]["held"]
        moments = res[r]["moments"]
        assert (held["exp_avg"], held["exp_avg_sq"]) == (moments["exp_avg"], moments["exp_avg_sq"])
        assert held["unsharded"] == 0


# =========================================================================== doctor: a collective's bytes

def collectives_left(ctx, directory):
    """Four collectives through minishard's Comm, each of another op and dtype; the trace and the
    flight dump left in ``directory``. Returns each one's bytes by minishard's convention (the
    buffer reduced, the whole gathered or scattered buffer, the buffer broadcast), counted
    from the tensors issued."""
    comm = Comm(ctx.tracer, group=dist.new_group(list(range(ctx.world_size))))
    grads = torch.ones(3, 5, dtype=torch.bfloat16)
    comm.all_reduce(grads, tag="grads")
    shard, whole = torch.ones(6), torch.empty(6 * ctx.world_size)
    comm.all_gather(whole, shard, tag="unit0")
    comm.reduce_scatter(shard, whole, tag="unit0")
    weights = torch.zeros(7, dtype=torch.int64)
    comm.broadcast(weights, tag="weights")
    ctx.tracer.write_jsonl(f"{directory}/rank{ctx.rank}.jsonl")
    comm.flight.dump(directory, "end")
    return {op: t.numel() * t.element_size() for op, t in
            (("all_reduce", grads), ("all_gather", whole), ("reduce_scatter", whole),
             ("broadcast", weights))}


def test_the_doctor_prints_each_collectives_bytes_as_counted_from_its_tensors(pools, tmp_path):
    """Real ranks' dumps, then two findings made from them: rank 1's last collective dropped
    from its dump (a hang: the broadcast the others issued and rank 1's reduce-scatter are
    printed), and rank 1's dump removed (its trace's last collective is printed)."""
    sizes = pools(N).run(collectives_left, str(tmp_path))[0]
    assert sizes == {"all_reduce": 30, "all_gather": 48, "reduce_scatter": 48, "broadcast": 56}
    for r in range(N):
        for e in json.loads((tmp_path / f"flight_rank{r}.json").read_text())["entries"]:
            assert doctor.describe(e).endswith(f", {fmt_bytes(sizes[e['op']])}"), doctor.describe(e)
    path = tmp_path / "flight_rank1.json"
    body = json.loads(path.read_text())
    body["entries"].pop()
    path.write_text(json.dumps(body))
    (hang,) = doctor.diagnose(tmp_path).findings
    assert hang.kind == "hang" and hang.ranks == [1]
    assert hang.evidence[0].startswith(f"rank 0: seq 3 broadcast of weights [7] int64, {fmt_bytes(56)} — ")
    assert hang.evidence[1].startswith(f"rank 1, its last collective: seq 2 reduce_scatter of unit0 "
                                       f"[{6 * N}] float32, {fmt_bytes(48)} — ")
    path.unlink()
    gone = [f for f in doctor.diagnose(tmp_path).findings if f.kind == "missing_dump"][0]
    last = f"its last completed collective broadcast (int64, {fmt_bytes(56)})"
    assert gone.evidence[0].endswith(last), gone.evidence


# PyTorch's names for dtypes in its flight recorder, and the dtype each is
PYTORCH_DTYPES = {"Float": torch.float32, "Double": torch.float64, "Half": torch.float16,
                  "BFloat16": torch.bfloat16, "Long": torch.int64, "Int": torch.int32,
                  "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8, "Bool": torch.bool}


def test_the_doctor_prints_pytorchs_own_dumps_bytes_as_numel_times_element_size(tmp_path):
    """A PyTorch flight-recorder dump (pickle, gloo) with a collective in each dtype and a
    two-tensor one: the bytes the doctor prints are the numel x element size of tensors of those
    shapes and dtypes, made here."""
    shapes = [[3, 5], [2, 2, 7], [11]]
    entries = [{"profiling_name": "gloo:all_reduce", "process_group": ["0", "default_pg"],
                "collective_seq_id": i, "input_sizes": [shapes[i % 3]], "input_dtypes": [name],
                "state": "completed"} for i, name in enumerate(PYTORCH_DTYPES)]
    entries.append({"profiling_name": "gloo:all_gather", "process_group": ["0", "default_pg"],
                    "collective_seq_id": len(entries), "input_sizes": [[4, 3], [9]],
                    "input_dtypes": ["BFloat16", "Long"], "state": "completed"})
    (tmp_path / "torch_fr_trace_rank_0").write_bytes(pickle.dumps({"entries": entries}))
    report = doctor.read_dir(tmp_path)
    got = report.dumps[0]["entries"]
    assert len(got) == len(entries)
    for e, raw in zip(got, entries):
        tensors = [torch.empty(s, dtype=PYTORCH_DTYPES[d])
                   for s, d in zip(raw["input_sizes"], raw["input_dtypes"])]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        assert doctor.describe(e).endswith(f", {fmt_bytes(nbytes)}"), (raw, doctor.describe(e))


# =========================================================================== meter: a run's counters

def test_the_meter_counts_the_training_traffic_not_the_set_up():
    """A run's per-collective table (``by_op``) is what training moved: the broadcast that made
    the replicas equal happened before the meter started and is not a training collective.
    Counted in, a run would report a broadcast every step never made, and more bytes."""
    from minishard.training.meter import Meter
    comm = Comm(alone=True)
    weights, grad = torch.zeros(1000), torch.ones(3, 5)
    comm.broadcast(weights, 0, tag="replicate")                    # the set-up
    meter = Meter([comm])
    with meter.step():
        comm.all_reduce(grad, tag="grad:w")                        # the training
    nbytes = grad.numel() * grad.element_size()                    # 60
    assert set(meter.by_op()) == {"all_reduce"}
    assert meter.by_op()["all_reduce"]["payload"] == nbytes
    assert meter.by_op()["all_reduce"]["calls"] == 1
    assert (meter.steps["payload"], meter.steps["calls"]) == ([nbytes], [1])


def test_the_meter_reports_each_steps_own_exposed_seconds():
    """Exposed communication is reported per step: units that waited 0.5 s in all in the first
    step and 0.25 s in the second report [0.5, 0.25] — the running total [0.5, 0.75] would make
    every later step look slower on the network than it was. (A unit's counter only grows; these
    are binary fractions, exact in floating point.)"""
    from types import SimpleNamespace

    from minishard.strategies.offload import TransferLog
    from minishard.training.meter import Meter
    units = [SimpleNamespace(exposed_s=0.0, transfers=TransferLog()) for _ in range(2)]
    meter = Meter([], units)
    with meter.step():
        units[0].exposed_s += 0.5
        units[0].transfers.add("h2d", 4096, 0.125)
    with meter.step():
        units[0].exposed_s += 0.125
        units[1].exposed_s += 0.125
        units[1].transfers.add("d2h", 1024, 0.0625)
    assert meter.steps["exposed_comm"] == [0.5, 0.25]
    assert sum(meter.steps["exposed_comm"]) == sum(u.exposed_s for u in units)
    assert [(x["h2d_bytes"], x["d2h_bytes"]) for x in meter.steps["transfer"]] == [(4096, 0), (0, 1024)]


def test_the_optimizers_step_hooks_take_the_same_note_around_each_step():
    """``note_steps``, as a run takes its notes: the copy before the step by the optimizer's
    pre-step hook, the count after it by its post-step hook, with the step and the norm the
    gradients were clipped by; once removed, a step is not noted."""
    w16 = torch.nn.Parameter(torch.ones(4, 8, dtype=torch.bfloat16))
    w16.grad = torch.full_like(w16, 0.25)
    w16.grad[0, :3] = 1e-4                                         # 3 updates rounded away
    opt = torch.optim.SGD([w16], lr=1.0)
    facts: dict = {}
    removers = health.note_steps(opt, facts, lambda: 7, lambda: torch.tensor(2.5))
    opt.step()
    for remove in removers:
        remove()
    opt.step()
    assert facts["steps"] == [{"step": 7, "param_dtypes": ["bfloat16"], "low_precision_elements": 32,
                               "unchanged": 3, "grad_norm": 2.5}]
