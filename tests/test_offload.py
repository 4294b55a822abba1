"""Offload: the sharded state lives in host memory or memory-mapped files; training is
unchanged, the device holds less, and exactly the shard bytes cross over each step."""
import math
import os

import pytest

from minishard.core.launch import RankError
from minishard.core.model import GPT
from minishard.strategies.offload import (CPUOffloadPolicy, DiskOffloadPolicy, OffloadError, OffloadPolicy,
                                          Tier)
from minishard.training.loop import TrainConfig, train

from parity import assert_parity, reference

KW = dict(model="nano", steps=3, optimizer="sgd_momentum", lr=0.05)


@pytest.mark.parametrize("N", [1, 2, 3, 4])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_offload_keeps_parity(pools, N, tier, tmp_path):
    for strategy in ("fsdp", "fsdp_flat"):
        ours = pools(N).run(train, TrainConfig(strategy=strategy, micro_batch=2, return_params=True, offload=tier, offload_dir=str(tmp_path), **KW))
        assert_parity(ours, reference(N, 2, **KW))
    assert list(tmp_path.iterdir()) == []            # each rank removed its files


def test_offload_with_adamw_keeps_parity(pools, tmp_path):
    kw = dict(model="nano", steps=3)
    ours = pools(2).run(train, TrainConfig(strategy="fsdp", micro_batch=2, return_params=True, offload="disk", offload_dir=str(tmp_path), **kw))
    assert_parity(ours, reference(2, 2, **kw))


def _shard_bytes(N: int, layout: str = "flat") -> list[int]:
    """fp32 bytes of each unit's shard: blocks, then the root. Flat: ceil(unit / N) elements;
    per parameter: each parameter's ceil(rows / N) rows."""
    net = GPT("nano", device="meta")
    units = [list(b.parameters()) for b in net.blocks]
    units.append([p for n, p in net.named_parameters() if not n.startswith("blocks.")])
    if layout == "flat":
        return [4 * math.ceil(sum(p.numel() for p in u) / N) for u in units]
    return [4 * sum(math.ceil(p.shape[0] / N) * (p.numel() // p.shape[0]) for p in u) for u in units]


@pytest.mark.parametrize("N", [2, 3])
@pytest.mark.parametrize("strategy", ["fsdp_flat", "fsdp"])
def test_transfer_bytes_equal_the_state_sizes(pools, N, strategy):
    res = pools(N).run(train, TrainConfig(strategy=strategy, micro_batch=1, offload="host", track_activations=False, **KW))
    sizes = _shard_bytes(N, "flat" if strategy == "fsdp_flat" else "per_param")
    blocks, root = sizes[:-1], sizes[-1]
    for r in res:
        for step in r["transfer"]:
            # in: every unshard fetches its shard — blocks twice (forward, backward), the root
            # once (it stays gathered); out: every reduced gradient slice, once
            assert step["h2d_bytes"] == 2 * sum(blocks) + root
            assert step["d2h_bytes"] == sum(blocks) + root
        # the formula the run report sets beside them, each direction its own
        assert r["ledger"]["transfer_formula"] == {"h2d_bytes": 2 * sum(blocks) + root,
                                                   "d2h_bytes": sum(blocks) + root}
        host = r["ledger"]["by_device"]["host"]
        assert host == {"params": sum(blocks) + root, "grads": sum(blocks) + root,
                        "momentum": sum(blocks) + root}
        assert not {"params", "grads", "momentum"} & set(r["ledger"]["by_device"].get("device", {}))


def where_the_state_lives(rank, layout: str, directory: str) -> dict:
    """Rank task: FSDP with the disk tier, two SGD-momentum steps (``zero_grad()`` dropping the
    gradients in between, torch's default); for every shard, its gradient
    and its momentum, the file its memory is mapped from (None: not in the tier); each unit's
    folder; what of the rank's folders is left after the units released their tiers."""
    import os

    import torch
    from minishard.strategies import fsdp
    from minishard.core.comm import Comm
    from minishard.core.model import batch, config
    from minishard.strategies.offload import DiskOffloadPolicy
    cfg = config("nano")
    comm = Comm(rank.tracer)
    net = GPT(cfg, seed=0)
    fsdp.apply_fsdp(net, comm=comm, layout=layout, offload_policy=DiskOffloadPolicy(directory))
    opt = fsdp.ShardedOptimizer(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    files = lambda t: t.untyped_storage().filename   # noqa: E731
    out = {"tier": os.path.join(directory, f"rank{rank.rank}-"),
           "folders": {u.name: str(u.tier.directory) for u in fsdp.units(net)}}
    for step in range(2):
        if step:
            opt.zero_grad()             # torch's default: set_to_none=True
        x, y = batch(cfg, step, 1, rank.rank, rank.world_size)
        net(x, y).backward()
        opt.step()
        out[f"grads{step}"] = [files(p.grad) for p in net.parameters()]
        out[f"local{step}"] = all(type(p.grad).__name__ == "LocalGradient" for p in net.parameters())
    out["params"] = [files(p) for p in net.parameters()]
    out["momentum"] = [files(opt.state[p]["momentum_buffer"]) for p in net.parameters()]
    for u in fsdp.units(net):
        out.setdefault("by_unit", {})[u.name] = {files(t) for t in u.offloaded()}
        u.release_tier()
    out["left"] = [f for f in os.listdir(directory) if f.startswith(f"rank{rank.rank}-")]
    return out


@pytest.mark.parametrize("layout", ["per_param", "flat"])
def test_the_disk_tier_holds_every_shard_its_gradient_and_its_moments(pools, layout, tmp_path):
    """Nothing of the sharded state is left on the device: each tensor's memory is a file of
    the rank's tier directory, in a folder of the unit's own; the folders go when the units
    release their tiers."""
    for r in pools(2).run(where_the_state_lives, layout, str(tmp_path)):
        assert len(set(r["folders"].values())) == len(r["folders"]) == 4      # 3 blocks + root
        for name, folder in r["folders"].items():
            assert os.path.basename(folder).startswith(f"{os.path.basename(r['tier'])}{name}-")
            assert all(os.path.dirname(f) == folder for f in r["by_unit"][name])
        assert r["left"] == []
        # the shard's gradient refuses a norm of its own (minishard.strategies.local_grad), before and
        # after zero_grad() dropped it
        assert r["local0"] and r["local1"]
        for what in ("params", "grads0", "grads1", "momentum"):     # grads1: after zero_grad()
            assert r[what] and all(f is not None and f.startswith(r["tier"]) for f in r[what]), (what, r[what])


def test_offload_fits_a_budget_that_plain_fsdp_does_not(pools):
    budget = 80 * 2**20             # bytes of "device" memory per rank
    kw = dict(strategy="fsdp_flat", model="tiny", micro_batch=2, steps=2, device_budget=budget)
    with pytest.raises(RankError, match="over its budget"):
        pools(2).run(train, TrainConfig(**kw))
    fits = pools(2).run(train, TrainConfig(offload="host", **kw))
    assert all(r["ledger"]["peak"] <= budget for r in fits)


def test_bad_offload_requests_are_named(tmp_path):
    with pytest.raises(TypeError, match="no-offload policy and takes no arguments.*CPUOffloadPolicy"):
        OffloadPolicy("host")               # minishard's old spelling: refused, by name
    with pytest.raises(ValueError, match="needs the folder"):
        DiskOffloadPolicy("")
    with pytest.raises(TypeError, match="pin_memory='yes'.*True or False"):
        CPUOffloadPolicy(pin_memory="yes")
    with pytest.raises(ValueError, match="offloads nothing"):
        Tier(OffloadPolicy())
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(OffloadError, match="cannot be created"):
        Tier(DiskOffloadPolicy(str(blocker / "sub")))
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(OffloadError, match="MiB free"):
        Tier(DiskOffloadPolicy(str(tmp_path / "big")), needed_bytes=free * 2)
    assert not any((tmp_path / "big").iterdir())      # nothing half-written


def test_a_run_checks_room_for_the_whole_state_before_any_unit_is_made(tmp_path, monkeypatch):
    """Each unit checks room for its own part; a run first checks room for all of it, so that a
    disk with room for every unit alone but not for them together refuses before writing a
    file (a memory-mapped file is sparse: a full disk would show only later, as a crash)."""
    import shutil
    from collections import namedtuple

    from minishard.core.comm import Comm
    from minishard.strategies import build
    net = GPT("nano")
    whole = 16 * sum(p.numel() for p in net.parameters())
    largest = 16 * max(sum(p.numel() for p in b.parameters()) for b in net.blocks)
    assert largest * 2 < whole
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 * whole, 0, whole // 2))
    with pytest.raises(OffloadError, match="MiB free; the offloaded state needs"):
        build(net, TrainConfig(strategy="fsdp", model="nano", offload="disk", offload_dir=str(tmp_path)), Comm())
    assert list(tmp_path.iterdir()) == []              # no unit's folder, no file
    assert not any(hasattr(m, "_fsdp_unit") for m in net.modules())


def build_with_free_space(rank, directory: str, free: int) -> str:
    """Rank task: a disk-offload FSDP build of nano with ``free`` bytes said to be free; what it
    says ("built", or the error)."""
    import shutil
    from collections import namedtuple

    from minishard.core.comm import Comm
    from minishard.strategies import build
    usage, real = namedtuple("usage", "total used free"), shutil.disk_usage
    shutil.disk_usage = lambda _: usage(10 * free, 0, free)
    try:                        # (a warm rank process runs other tasks after this one)
        built = build(GPT("nano"), TrainConfig(strategy="fsdp", model="nano", offload="disk",
                                               offload_dir=directory), Comm())
    except OffloadError as e:
        return str(e)
    finally:
        shutil.disk_usage = real
    for unit in built.units:
        unit.release_tier()
    return "built"


def test_each_rank_checks_room_for_its_own_share_of_the_state(pools, tmp_path):
    """On N ranks a rank's tier holds 16Ψ/N bytes (and a little padding): room for that is
    enough, room for less is refused."""
    whole = 16 * GPT("nano", device="meta").num_params()
    assert pools(2).run(build_with_free_space, str(tmp_path), int(0.6 * whole)) == ["built"] * 2
    refused = pools(2).run(build_with_free_space, str(tmp_path), int(0.4 * whole))
    assert all("MiB free; the offloaded state needs" in r for r in refused), refused


def test_each_unit_checks_room_for_its_shards_their_gradients_and_two_moments(tmp_path, monkeypatch):
    """A unit made by hand (``fully_shard``) asks room for 16 bytes an element of its shard:
    the fp32 shard, its gradient, Adam's two moments — 4 bytes an element is not enough."""
    import shutil
    from collections import namedtuple

    from minishard.strategies import fsdp
    block = GPT("nano").blocks[0]
    numel = sum(p.numel() for p in block.parameters())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(100 * numel, 0, 8 * numel))
    with pytest.raises(OffloadError, match="MiB free; the offloaded state needs"):
        fsdp.fully_shard(block, offload_policy=DiskOffloadPolicy(str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


def test_the_chapters_disk_listing_counts_every_units_folder(pools, tmp_path):
    """Chapter 08's ``disk_tier_files``: one file per shard tensor — every unit's parameter
    shard, its gradient shard, its two moments — in a folder per unit, 16Ψ/N bytes in all, and
    nothing left once the run is over."""
    from minishard.course.ch08 import disk_tier_files
    from minishard.core.model import config
    L, psi = config("nano").n_layer, GPT("nano", device="meta").num_params()
    for r in pools(2).run(disk_tier_files, str(tmp_path), model="nano"):
        assert r["units"] == L + 1 and r["files"] == 4 * (L + 1)
        assert r["bytes"] == 16 * psi // 2 and not r["left_behind"]


def test_a_transfer_event_starts_when_the_copy_started():
    """The timeline draws a transfer from its ``t`` for its ``seconds``: a copy that took 0.25 s
    and was entered when it ended must start 0.25 s before that — drawn from its end instead,
    it would sit after the copy, over whatever the rank did next."""
    from minishard.core.trace import Tracer
    from minishard.strategies.offload import TransferLog
    tracer, log = Tracer(), TransferLog()
    before = tracer.now()
    log.add("h2d", 4096, 0.25, tracer, tag="blocks.0")             # the copy ended just now
    after = tracer.now()
    (ev,) = [e for e in tracer.events if e["kind"] == "transfer"]
    assert (ev["direction"], ev["bytes"], ev["seconds"], ev["tag"]) == ("h2d", 4096, 0.25, "blocks.0")
    slack = 1e-6                                                   # t is rounded to 7 digits
    assert before - 0.25 - slack <= ev["t"] <= after - 0.25 + slack
    assert log.bytes == {"h2d": 4096, "d2h": 0} and log.seconds == {"h2d": 0.25, "d2h": 0.0}


# ---------------------------------------------------------------------------- only the optimizer

def test_optimizer_only_offload_keeps_parity(pools):
    """ZeRO-Offload's choice (``ShardedOptimizer(offload_policy=CPUOffloadPolicy())``): the step
    runs on the tier's master copies, and trains as one process does on the global batch — bit
    for bit as the same FSDP run with nothing offloaded."""
    from minishard.course.ch08 import offload_compare
    kw = dict(model="nano", steps=3)
    ours = pools(2).run(offload_compare, "optimizer", micro_batch=2, return_params=True, **kw)
    assert_parity(ours, reference(2, 2, **kw))
    plain = pools(2).run(offload_compare, "nothing", micro_batch=2, return_params=True, **kw)
    assert_parity(ours, {"losses": [sum(r["losses"][s] for r in plain) / 2 for s in range(3)],
                         "params": plain[0]["params"]}, bitwise=True)


@pytest.mark.parametrize("N", [2, 3])
def test_optimizer_only_against_everything_bytes_and_memory_equal_the_formula(pools, N):
    """Per step, optimizer-only moves every gradient shard out and every updated shard in, once
    (S each way, S the rank's fp32 shard bytes); everything-offloaded moves each unit's shard
    in per gather (2·blocks + root) and the gradients out (S). At rest the device keeps S of
    parameters and S of gradients with optimizer-only, nothing with everything; the tier holds
    4S either way. The device peaks fall by 2S and 4S from the run with nothing offloaded."""
    from minishard.course.ch08 import offload_compare
    sizes = _shard_bytes(N, "flat")
    S, blocks, root = sum(sizes), sum(sizes[:-1]), sizes[-1]
    runs = {w: pools(N).run(offload_compare, w, model="nano", micro_batch=1)
            for w in ("nothing", "optimizer", "everything")}
    for i in range(N):
        nothing, opt, every = (runs[w][i] for w in ("nothing", "optimizer", "everything"))
        assert opt["losses"] == every["losses"] == nothing["losses"]
        assert all(m == {"h2d": S, "d2h": S} for m in opt["moved"])
        assert all(m == {"h2d": 2 * blocks + root, "d2h": S} for m in every["moved"])
        assert all(m == {"h2d": 0, "d2h": 0} for m in nothing["moved"])
        assert opt["by_device"] == {"device": {"params": S, "grads": S},
                                    "host": {"master": S, "grads": S, "exp_avg": S, "exp_avg_sq": S}}
        assert every["by_device"] == {"host": dict.fromkeys(("params", "grads", "exp_avg", "exp_avg_sq"), S)}
        assert nothing["peak"] - opt["peak"] == 2 * S
        assert nothing["peak"] - every["peak"] == 4 * S


def test_bad_offload_policies_are_named():
    """A value that is not a policy, and offloading the optimizer state two ways at once, are
    refused with what was given and what is taken."""
    import torch
    from minishard.core.comm import Comm
    from minishard.strategies import fsdp
    with pytest.raises(TypeError, match="offload_policy='host' is not an offload policy.*CPUOffloadPolicy"):
        fsdp.fully_shard(torch.nn.Linear(2, 2), comm=Comm(alone=True), offload_policy="host")
    net = fsdp.fully_shard(torch.nn.Linear(2, 2), comm=Comm(alone=True), offload_policy=CPUOffloadPolicy())
    adam = torch.optim.AdamW(net.parameters())
    with pytest.raises(TypeError, match="ShardedOptimizer: offload_policy=True is not an offload policy"):
        fsdp.ShardedOptimizer(net, adam, offload_policy=True)
    with pytest.raises(ValueError, match="already keep the optimizer state in their tier.*offload one way"):
        fsdp.ShardedOptimizer(net, adam, offload_policy=CPUOffloadPolicy())


# ---------------------------------------------------------------------------- a fourth outsider's round

def test_each_tier_name_stands_for_its_policy(tmp_path):
    """``TrainConfig(offload=...)``'s names: None no offload, "host" FSDP2's CPUOffloadPolicy
    (pinned by default), "disk" the memory-mapped files of a folder; anything else refused."""
    from minishard.strategies.offload import policy_of
    assert type(policy_of(None)) is OffloadPolicy and policy_of(None).tier is None
    host = policy_of("host")
    assert type(host) is CPUOffloadPolicy and host.tier == "host" and host.pin_memory is True
    disk = policy_of("disk", str(tmp_path))
    assert type(disk) is DiskOffloadPolicy and disk.directory == str(tmp_path)
    with pytest.raises(ValueError, match="needs a directory"):
        policy_of("disk")
    with pytest.raises(ValueError, match="unknown offload tier 'nvme'"):
        policy_of("nvme")


def test_none_as_an_offload_policy_offloads_nothing():
    """``offload_policy=None`` reads as ``OffloadPolicy()``: no unit tier, no optimizer tier."""
    import torch
    from minishard.core.comm import Comm
    from minishard.strategies import fsdp
    net = fsdp.fully_shard(torch.nn.Linear(2, 2), comm=Comm(alone=True), offload_policy=None)
    assert all(u.tier is None and u.offloaded() == {} for u in fsdp.units(net))
    opt = fsdp.ShardedOptimizer(net, torch.optim.AdamW(net.parameters()), offload_policy=None)
    assert opt.offload is None


@pytest.mark.parametrize("cuda", [False, True])
def test_a_host_tier_pins_only_when_asked_and_a_cuda_device_exists(monkeypatch, tmp_path, cuda):
    """FSDP2's ``pin_memory``: True pins the host copies (where CUDA exists), False never does;
    a disk tier has nothing to pin."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert Tier(CPUOffloadPolicy()).pin is cuda
    assert Tier(CPUOffloadPolicy(pin_memory=False)).pin is False
    disk = Tier(DiskOffloadPolicy(str(tmp_path)))
    assert not disk.pin
    disk.cleanup()


def test_optimizer_offload_steps_what_has_a_gradient_and_gives_each_tensor_back():
    """ZeRO-Offload's step on plain tensors: a frozen parameter gets no master copy; one with no
    gradient this step is left alone (torch skips it too) and moves no bytes; one with a
    gradient steps on its master copy and comes back into the very storage and gradient it had,
    equal to the master; 4 bytes an element each way."""
    import torch
    from minishard.strategies.offload import OptimizerOffload
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    off = OptimizerOffload(CPUOffloadPolicy(), [a, b, frozen])
    assert [id(p) for p in off.params] == [id(a), id(b)] and len(off.master) == len(off.grads) == 2
    opt = torch.optim.SGD([a, b, frozen], lr=0.5)
    a.grad = torch.ones_like(a)
    a_ptr, a_grad, a_before, b_before = a.data_ptr(), a.grad, a.detach().clone(), b.detach().clone()
    with off.stepping():
        assert a.data_ptr() == off.master[a].data_ptr() and a.grad is off.grads[a]
        assert b.grad is None
        opt.step()
    assert a.data_ptr() == a_ptr and a.grad is a_grad
    assert torch.equal(a.detach(), a_before - 0.5) and torch.equal(off.master[a], a.detach())
    assert torch.equal(b.detach(), b_before) and b.grad is None
    assert off.transfers.bytes == {"h2d": 4 * 12, "d2h": 4 * 12}


def optimizer_tier_files(rank, directory: str) -> dict:
    """Rank task: Chain sharded with nothing offloaded, AdamW over two parameter groups (the
    blocks decayed, the head not), only the optimizer offloaded to a disk tier: for every
    parameter, the files its moments are mapped from before and after a step; the bytes moved."""
    import torch
    from minishard.core.comm import Comm
    from minishard.strategies import fsdp
    from chain import Chain
    torch.manual_seed(0)
    net = fsdp.apply_fsdp(Chain(), comm=Comm(rank.tracer))
    groups = [{"params": list(net.blocks.parameters())}, {"params": list(net.head.parameters()), "weight_decay": 0.0}]
    opt = fsdp.ShardedOptimizer(net, torch.optim.AdamW(groups, lr=1e-2), offload_policy=DiskOffloadPolicy(directory))
    files = lambda p: [opt.state[p][k].untyped_storage().filename if k in opt.state[p] else None   # noqa: E731
                       for k in ("exp_avg", "exp_avg_sq")]
    out = {"before": [files(p) for p in net.parameters()]}
    net(torch.ones(2, 8)).backward()
    opt.step()
    out["after"] = [files(p) for p in net.parameters()]
    out["moved"] = dict(opt.offload.transfers.bytes)
    out["shard_bytes"] = sum(p.numel() * p.element_size() for p in net.parameters())
    out["offloaded"] = len(opt.offload.params) == len(list(net.parameters()))
    opt.offload.release()
    return out


def test_optimizer_only_disk_tier_holds_every_groups_moments(pools, tmp_path):
    """``ShardedOptimizer(offload_policy=DiskOffloadPolicy(...))`` over units that offload
    nothing: every parameter group's shards are offloaded, their moments are files of the tier
    from before the first step, and every shard crosses once each way."""
    for r in pools(2).run(optimizer_tier_files, str(tmp_path)):
        assert r["offloaded"]
        for when in ("before", "after"):
            assert all(f is not None and f.startswith(str(tmp_path)) for fs in r[when] for f in fs), (when, r[when])
        assert r["moved"] == {"h2d": r["shard_bytes"], "d2h": r["shard_bytes"]}
