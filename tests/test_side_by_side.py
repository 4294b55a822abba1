"""minishard's FSDP, DDP and ZeRO-1 beside PyTorch's FSDP2, DDP and ZeroRedundancyOptimizer.

The same nano GPT, wrapping (each block a unit, then the root), precision, batches and loop run
under both; minishard's run is traced by its engine, torch's by ``minishard.watch``; the tables
of ``minishard.course.side_by_side`` are asserted row by row. Every difference allowed here is
one docs/side-by-side.md explains, and its size is asserted by its formula. Two planted changes
(torch's backward prefetch off; minishard's buckets reversed) must make the tables differ.
"""
import pytest
import torch

from minishard.course import side_by_side as sbs
from minishard.core.model import GPT, config

from side_by_side_tasks import STEPS

NANO = dict(model="nano", micro_batch=2)
FSDP = dict(NANO, prefetch=1)               # minishard's depth 1 both ways = FSDP2's backward rule
BUCKETS = dict(NANO, bucket_cap_mb=0.25)    # a few buckets on nano (4 B x 217,664 = 0.83 MiB)
PSI = GPT(config("nano"), device="meta").num_params()
FIRST_BUCKET = torch.distributed._DEFAULT_FIRST_BUCKET_BYTES   # the rebuilt buckets' first cap
BATCH_IDS = NANO["micro_batch"] * config("nano").seq_len * 8      # B x T int64: ids, or targets

SCENARIOS = {   # name -> (minishard's strategy, torch's, knobs, plant on torch's, on minishard's)
    "fsdp": ("fsdp", "torch_fsdp", FSDP, None, None),
    "fsdp_bf16": ("fsdp", "torch_fsdp", dict(FSDP, precision="bf16_mixed"), None, None),
    "ddp": ("ddp", "torch_ddp", BUCKETS, None, None),
    "zero1": ("zero1", "torch_zero1", BUCKETS, None, None),
    "planted_prefetch": ("fsdp", "torch_fsdp", FSDP, None, "plant_no_backward_prefetch"),
    "planted_buckets": ("ddp", "torch_ddp", BUCKETS, None, "plant_reversed_buckets"),
}


@pytest.fixture(scope="module")
def runs(pools):
    """Every 2-rank scenario in one launch: ``{name: [(mine, theirs) per rank]}``."""
    names = list(SCENARIOS)
    per_rank = pools(2).run("side_by_side_tasks:pair", [SCENARIOS[n] for n in names])
    return {n: [per_rank[r][i] for r in range(2)] for i, n in enumerate(names)}


# --------------------------------------------------------------------------- FSDP

def _check_fsdp(mine, theirs, rank, world):
    t = sbs.compare_fsdp(mine, theirs, rank, step=1)
    # lifecycle: the same per unit, except FSDP2's reshard before its reduce-scatter
    assert {r["unit"] for r in t["lifecycle"]} == {"root", "blocks.0", "blocks.1", "blocks.2"}
    bad = [r for r in t["lifecycle"] if r["difference"] is None]
    assert not bad, "lifecycles differ beyond the documented order:\n" + sbs.render(bad)
    # gathers in the same order, forward and backward (prefetch included)
    bad = [r for r in t["gathers"] if r["difference"] != "same"]
    assert not bad, "all-gather order differs:\n" + sbs.render(bad)
    # forward: the units' states interleaved alike (a forward prefetch gathers the next unit
    # before this one reshards; the all-gathers alone run in the same order either way)
    assert sbs.interleaving(mine, rank) == sbs.interleaving(theirs, rank), \
        "\n".join(f"{a:<28}{b}" for a, b in zip(sbs.interleaving(mine, rank), sbs.interleaving(theirs, rank)))
    # every collective: op, unit, payload, dtype, in issue order
    bad = [r for r in t["collectives"] if r["difference"] != "same"]
    assert not bad, "collectives differ:\n" + sbs.render(t["collectives"])
    peak = {(r["category"], r["phase"]): r for r in t["peaks"]}
    # to the byte: the shards, the gathered parameters, the optimizer moments, every phase
    # optimizer moments: minishard's shards are equal chunks, padding included; FSDP2's moments
    # are zeros_like its local shard, which the padding is not part of (a short last chunk)
    pad = padding(rank, world)
    for c in ("params", "exp_avg", "exp_avg_sq"):
        for ph in ("all", *sbs.PHASES):
            r = peak[(c, ph)]
            assert r["mine"] - r["theirs"] == (0 if c == "params" else pad["local"]), sbs.render(t["peaks"])
    # gathered parameters: FSDP2's unsharded parameters are views of its padded all-gather
    # output, minishard's are allocated at their own size (padding): the root and one block
    ag = {c["tag"]: c["payload"] for c in t["collectives"] if c["op"] == "all_gather"}
    held = unit_bytes(None, t)
    for ph in ("forward", "backward"):
        r = peak[("unsharded", ph)]
        assert r["theirs"] == ag["root"] + ag["blocks.0"], r
        assert r["mine"] == held["root"] + held["blocks.0"], r
        assert r["theirs"] - r["mine"] == pad["root"] + pad["blocks.0"], r
    # comm buffers: equal in backward; in forward FSDP2 frees an all-gather output only after
    # the next unit's copy-out (deferred_all_gather_free): two consecutive outputs at once
    ag = [c["payload"] for c in t["collectives"] if c["op"] == "all_gather" and c["phase"] == "forward"]
    # backward: minishard's gloo reduce-scatter receives N-2 of the N-1 slices meant for this
    # rank into a buffer of its own (comm.py, receive_rows; FSDP2 on gloo all-reduces inside
    # c10d, unseen): one block's (N-2)/N of its reduce-scatter payload more, none on 2 ranks
    rs_block = max(c["payload"] for c in t["collectives"] if c["op"] == "reduce_scatter" and c["tag"] != "root")
    assert (peak[("comm_buffers", "backward")]["mine"] - peak[("comm_buffers", "backward")]["theirs"]
            == (world - 2) * rs_block // world), sbs.render(t["peaks"])
    assert peak[("comm_buffers", "forward")]["mine"] == max(ag)
    assert peak[("comm_buffers", "forward")]["theirs"] == max(a + b for a, b in zip(ag, ag[1:]))
    # gradients: after backward both hold the sharded gradients only (the reduce-scatter
    # outputs, each payload / N)
    rs = {c["tag"]: c["payload"] for c in t["collectives"] if c["op"] == "reduce_scatter"}
    shards = sum(rs.values()) // world
    assert peak[("grads", "optimizer")]["mine"] == peak[("grads", "optimizer")]["theirs"] == shards
    _check_grads_in_backward(mine, theirs, rank, world, t, peak, rs, shards)
    # activations: the same saves, the same bytes; after backward the watch still holds the
    # batch's token ids and targets (the caller holds them; docs: instrument gaps), minishard's
    # ledger nothing
    for ph in ("all", "forward", "backward"):
        r = peak[("activations", ph)]
        assert 0 < r["theirs"] == r["mine"], sbs.render(t["peaks"])
    r = peak[("activations", "optimizer")]
    assert r["mine"] == 0 and r["theirs"] == 2 * BATCH_IDS, r
    return t


def _check_grads_in_backward(mine, theirs, rank, world, t, peak, rs, shards):
    """The gradients in backward, moment by moment (backward order: blocks.2, .1, .0, root).
    Both sides hold the shards and the unsharded gradients autograd accumulates, alike. At each
    unit's reduce-scatter they part: FSDP2's foreach_reduce still holds the unit's *last*
    parameter's unsharded gradient (its loop variable; last_unsharded_grad_held), and the watch
    enters FSDP2's reduce-scatter output under ``grads``; minishard has dropped every full
    gradient and its ledger enters its own reduce-scatter output under ``grads`` too."""
    g = grad_bytes(t)
    out = {u: p // world for u, p in rs.items()}           # each unit's reduce-scatter output
    at = sbs.live_at(theirs, rank, 1, "grads",
                     lambda e: e["kind"] == "alloc" and e["tag"].endswith("(the reduce-scatter output)"))
    # (step 0's outputs live on as the shards' .grad: FSDP2 keeps them when .grad was None)
    held = {e["tag"].split()[0].removeprefix("grads:"): (e["bytes"], live) for e, live in at}
    assert list(held) == ["blocks.2", "blocks.1", "blocks.0", "root"], held
    for unit, (nbytes, live) in held.items():
        last = g["last_root"] if unit == "root" else g["last_block"]
        assert live.get(f"grads_unsharded:{unit}") == last, (unit, live)
        assert nbytes == out[unit], (unit, nbytes)
    for e, live in sbs.live_at(mine, rank, 1, "grads",
                               lambda e: e["kind"] == "collective" and e["op"] == "reduce_scatter"):
        assert not [tag for tag in live if tag.startswith(f"{e['tag']}:grad_full")], (e, live)
        assert live.get(f"{e['tag']}:rs_out") == out[e["tag"]], (e, live)   # its output, alike
    kinds = {e["tag"].split(":")[1].rstrip("0123456789") for e in mine
             if e["kind"] == "alloc" and e["category"] == "grads"}
    assert kinds == {"shard_grad", "grad_full", "rs_out"}, kinds
    # the peaks, from the shapes: a block's full gradients beside the root's first ones (ln_f,
    # head: backward reaches them before the blocks), both sides; FSDP2 then a block's or the
    # root's reduce-scatter output beside its last gradient; minishard the root's full gradients
    both = shards + g["root_first"] + g["block"]
    r = peak[("grads", "backward")]
    assert r["theirs"] == max(both, shards + g["root_first"] + g["last_block"] + out["blocks.0"],
                              shards + g["last_root"] + out["root"]), sbs.render(t["peaks"])
    # minishard keeps one reduce-scatter in flight while the next unit's backward runs (as
    # FSDP2 does on a GPU's streams; on gloo FSDP2's is synchronous): the previous unit's
    # output is still live beside the next one's full gradients (reduce_scatter_in_flight)
    assert r["mine"] == max(both + out["blocks.1"], shards + g["root"] + out["blocks.0"]), \
        sbs.render(t["peaks"])


def grad_bytes(t):
    """Unsharded gradient bytes (in the dtype the all-gathers carry: the compute dtype) of one
    block, the root, each one's last parameter (FSDP2's order: the module's), and the root's
    parameters backward reaches before the blocks (ln_f, head)."""
    item = {"float32": 4, "bfloat16": 2}[t["collectives"][0]["dtype"]]
    net = GPT(config("nano"), device="meta")
    blocks = {id(p) for p in net.blocks.parameters()}
    root = [p for p in net.parameters() if id(p) not in blocks]
    block = list(net.blocks[0].parameters())
    size = lambda ps: sum(p.numel() for p in ps) * item        # noqa: E731
    return {"block": size(block), "last_block": size(block[-1:]), "root": size(root),
            "last_root": size(root[-1:]),
            "root_first": size([*net.ln_f.parameters(), *net.head.parameters()])}


def unit_bytes(_, t):
    """Each unit's parameters at their own size, in the dtype its all-gathers carry."""
    item = {"float32": 4, "bfloat16": 2}[t["collectives"][0]["dtype"]]
    net = GPT(config("nano"), device="meta")
    blocks = sum(p.numel() for p in net.blocks[0].parameters())
    return {"root": (PSI - len(net.blocks) * blocks) * item, "blocks.0": blocks * item}


def padding(rank, world):
    """Padding bytes (fp32) by FSDP's rule: each parameter's dim 0 cut into ``world`` chunks of
    ceil(rows / world) rows. ``local``: rows this rank's equal chunk holds beyond its real ones;
    per unit: the rows the padded all-gather output holds beyond the parameter."""
    net = GPT(config("nano"), device="meta")
    def rows(params):
        extra = local = 0
        for p in params:
            r, cols = p.shape[0], p[0].numel()
            chunk = -(-r // world)
            extra += (chunk * world - r) * cols * 4
            local += (chunk - max(0, min(chunk, r - rank * chunk))) * cols * 4
        return extra, local
    blocks = {id(p) for p in net.blocks.parameters()}
    root = [p for p in net.parameters() if id(p) not in blocks]
    return {"root": rows(root)[0], "blocks.0": rows(net.blocks[0].parameters())[0],
            "local": rows(net.parameters())[1]}


@pytest.mark.parametrize("name", ["fsdp", "fsdp_bf16"])
def test_fsdp_matches_fsdp2_event_by_event(runs, name):
    for rank, (mine, theirs) in enumerate(runs[name]):
        t = _check_fsdp(mine, theirs, rank, 2)
        dtypes = {c["dtype"] for c in t["collectives"] if c["op"] == "all_gather"}
        assert dtypes == ({"bfloat16"} if name == "fsdp_bf16" else {"float32"})


def test_fsdp_on_three_ranks_pads_alike(pools):
    """3 ranks do not divide nano's rows: both sides pad each parameter's rows to a multiple of
    3, so the payloads still agree to the byte."""
    res = pools(3).run("side_by_side_tasks:pair", [SCENARIOS["fsdp"]])
    for rank in range(3):
        (mine, theirs), = res[rank]
        t = _check_fsdp(mine, theirs, rank, 3)
        gathered = sum(c["payload"] for c in t["collectives"] if c["op"] == "all_gather"
                       and c["phase"] == "forward")
        assert gathered > 4 * PSI and gathered % 3 == 0        # padded, and split 3 ways


def test_a_changed_prefetch_is_caught(runs):
    """minishard's backward prefetch off: the same gathers in the same order, each unit's own
    lifecycle the same, but each gather now comes after the reduce-scatter it used to precede:
    only the order of the collectives shows it."""
    mine, theirs = runs["planted_prefetch"][0]
    t = sbs.compare_fsdp(mine, theirs, 0, step=1)
    assert [r for r in t["collectives"] if r["difference"] != "same"], sbs.render(t["collectives"])


# --------------------------------------------------------------------------- DDP

def test_ddp_buckets_match_the_reducer_after_its_rebuild(runs):
    for rank, (mine, theirs) in enumerate(runs["ddp"]):
        rows = sbs.compare_ddp(mine, theirs, rank, steps=tuple(range(STEPS)))
        later = [r for r in rows if r["step"] > 0]
        assert later and all(r["difference"] == "same" for r in later), sbs.render(rows)
        assert [r["mine"] for r in later] == [r["theirs"] for r in later]
        assert sum(r["bytes"] for r in rows if r["step"] == 1) == 4 * PSI
        # step 0: torch's one bucket holds all of nano (first_step_bucket; docs/sources.md#pytorch-ddp)
        first = [r["their_bytes"] for r in rows if r["step"] == 0 and r["theirs"]]
        assert 4 * PSI <= FIRST_BUCKET and first == [4 * PSI]


def test_a_changed_bucket_order_is_caught(runs):
    mine, theirs = runs["planted_buckets"][0]
    rows = sbs.compare_ddp(mine, theirs, 0, steps=(1,))
    assert any(r["difference"] is None for r in rows), sbs.render(rows)


# --------------------------------------------------------------------------- ZeRO-1

def test_zero1_against_zero_redundancy_optimizer_bytes(runs):
    """By design: minishard reduce-scatters and all-gathers its buckets, ZeroRedundancyOptimizer
    all-reduces (DDP) and broadcasts each parameter from its owner (broadcast_from_owner). The
    same payload, 4 B x Ψ per op; what each rank sends differs."""
    n = 2
    wire = {}
    for rank, (mine, theirs) in enumerate(runs["zero1"]):
        rows = sbs.compare_zero1(mine, theirs, rank, steps=tuple(range(STEPS)))
        by = {(r["step"], r["side"], r["op"]): r for r in rows}
        for s in range(STEPS):
            assert {op for (st, side, op) in by if st == s and side == "mine"} == {"reduce_scatter", "all_gather"}
            assert {op for (st, side, op) in by if st == s and side == "theirs"} == {"all_reduce", "broadcast"}
            for side, op in (("mine", "reduce_scatter"), ("mine", "all_gather"),
                             ("theirs", "all_reduce"), ("theirs", "broadcast")):
                assert by[(s, side, op)]["payload"] == 4 * PSI, by[(s, side, op)]
            assert by[(s, "theirs", "broadcast")]["calls"] == len(list(GPT(config("nano"), device="meta").parameters()))
            # ring: a reduce-scatter and an all-gather each send (N-1)/N of the payload
            assert by[(s, "mine", "reduce_scatter")]["wire"] == by[(s, "mine", "all_gather")]["wire"] == 4 * PSI * (n - 1) // n
            assert by[(s, "theirs", "all_reduce")]["wire"] == 2 * 4 * PSI * (n - 1) // n
            wire.setdefault(s, []).append(by[(s, "theirs", "broadcast")]["wire"])
    for s, sent in wire.items():   # each parameter is sent once, by its owner: Ψ x 4 B in all
        assert sum(sent) == 4 * PSI, sent
