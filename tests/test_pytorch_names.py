"""PyTorch's names mean PyTorch's things: every public name minishard shares with PyTorch takes
the arguments PyTorch's takes under those names, with PyTorch's defaults, checked against the
installed torch (``docs/side-by-side.md``, "Names shared with PyTorch", lists them). A name whose
meaning or default drifts from torch's fails here."""
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as F
import torch.nn.parallel.distributed as torch_ddp

import minishard
from minishard import checkpoint
from minishard.strategies import fsdp

DOC = Path(__file__).resolve().parents[1] / "docs" / "side-by-side.md"

# minishard's name, the object, torch's object, the parameters both take (with one meaning)
SHARED = [
    ("fully_shard", fsdp.fully_shard, F.fully_shard,
     ("module", "reshard_after_forward", "mp_policy", "offload_policy")),
    ("set_modules_to_forward_prefetch", fsdp.set_modules_to_forward_prefetch,
     F.FSDPModule.set_modules_to_forward_prefetch, ("modules",)),
    ("set_modules_to_backward_prefetch", fsdp.set_modules_to_backward_prefetch,
     F.FSDPModule.set_modules_to_backward_prefetch, ("modules",)),
    ("clip_grad_norm_", fsdp.clip_grad_norm_, F.FullyShardedDataParallel.clip_grad_norm_, ("max_norm",)),
    ("no_sync", fsdp.no_sync, F.FullyShardedDataParallel.no_sync, ()),
    ("DDP", minishard.DDP.__init__, torch.nn.parallel.DistributedDataParallel.__init__,
     ("module", "bucket_cap_mb")),
    ("DDP.no_sync", minishard.DDP.no_sync, torch.nn.parallel.DistributedDataParallel.no_sync, ()),
    ("checkpoint.save", checkpoint.save, dcp.save, ()),
    ("checkpoint.load", checkpoint.load, dcp.load, ()),
]
POLICIES = [  # dataclasses: every field of minishard's is torch's, with torch's default
    ("MixedPrecisionPolicy", fsdp.MixedPrecisionPolicy, F.MixedPrecisionPolicy),
    ("OffloadPolicy", fsdp.OffloadPolicy, F.OffloadPolicy),
    ("CPUOffloadPolicy", fsdp.CPUOffloadPolicy, F.CPUOffloadPolicy),
]


def _resolved(name: str, param: str, default):
    """torch's default as it acts: DDP's ``bucket_cap_mb=None`` is its 25 MiB."""
    if (name, param, default) == ("DDP", "bucket_cap_mb", None):
        return torch_ddp._DEFAULT_BUCKET_CAP_MB
    return default


def _same(a, b) -> bool:
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        # minishard's fields are a subset of torch's (MixedPrecisionPolicy has no output_dtype)
        return type(a).__name__ == type(b).__name__ and all(getattr(b, k) == v for k, v in _fields(a).items())
    return a == b


def _fields(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


@pytest.mark.parametrize("name,ours,theirs,shared", SHARED, ids=[s[0] for s in SHARED])
def test_a_shared_function_takes_torchs_arguments_with_torchs_defaults(name, ours, theirs, shared):
    mine, torch_params = inspect.signature(ours).parameters, inspect.signature(theirs).parameters
    for p in shared:
        assert p in mine and p in torch_params, f"{name}: {p!r} missing on one side"
        want = _resolved(name, p, torch_params[p].default)
        assert _same(mine[p].default, want), f"{name}({p}=...): minishard {mine[p].default!r}, torch {want!r}"


@pytest.mark.parametrize("name,ours,theirs", POLICIES, ids=[p[0] for p in POLICIES])
def test_a_shared_policy_has_torchs_fields_and_defaults(name, ours, theirs):
    torch_fields = {f.name: f.default for f in dataclasses.fields(theirs)}
    for f in dataclasses.fields(ours):
        assert f.name in torch_fields, f"{name}.{f.name}: torch has no such field"
        assert f.default == torch_fields[f.name], f"{name}.{f.name}: minishard {f.default!r}, torch {torch_fields[f.name]!r}"
    assert issubclass(fsdp.CPUOffloadPolicy, fsdp.OffloadPolicy) and issubclass(F.CPUOffloadPolicy, F.OffloadPolicy)


def test_offload_policy_means_no_offload_and_cpu_offload_policy_host_memory():
    """FSDP2's meanings: the base class offloads nothing and is ``fully_shard``'s default."""
    assert fsdp.OffloadPolicy().tier is None and fsdp.CPUOffloadPolicy().tier == "host"
    assert _same(inspect.signature(fsdp.fully_shard).parameters["offload_policy"].default, F.OffloadPolicy())
    assert fsdp.DiskOffloadPolicy("/tmp").tier == "disk" and not hasattr(F, "DiskOffloadPolicy")


def test_the_side_by_side_doc_lists_every_shared_name():
    doc = DOC.read_text()
    section = doc[doc.index("## Names shared with PyTorch"):]
    for name in [s[0] for s in SHARED] + [p[0] for p in POLICIES] + ["DiskOffloadPolicy", "TrainConfig.prefetch"]:
        assert f"`{name}`" in section, f"docs/side-by-side.md does not list `{name}`"


def unit_states(rank, which: str) -> list[tuple[str, str]]:
    """Rank task: nano sharded a unit per block plus the root with each library's defaults
    (no prefetch call), two AdamW steps under ``minishard.watch``; the units' states in the
    second step, minishard's ``reduce_scattering`` dropped (FSDP2 has no such state)."""
    import json
    import tempfile
    torch.manual_seed(0)
    net = minishard.GPT("nano")
    if which == "torch":
        for b in net.blocks:
            F.fully_shard(b)
        F.fully_shard(net)
    else:
        for i, b in enumerate(net.blocks):
            minishard.fully_shard(b, name=f"blocks.{i}")
        minishard.fully_shard(net, name="root")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    cfg, out = minishard.model_config("nano"), tempfile.mkdtemp()
    with minishard.watch(net, opt, trace=out) as w:
        for step in range(2):
            x, y = minishard.batch(cfg, step, 2, rank.rank, rank.world_size)
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
            w.step()
    events = [json.loads(line) for line in open(f"{out}/rank{rank.rank}.jsonl")]
    return [(e["name"], e["state"]) for e in events if e.get("kind") == "unit" and e.get("step") == 1
            and e["state"] != "reduce_scattering"]


def test_the_default_prefetch_is_fsdp2s(pools):
    """With no prefetch asked for, minishard's ``fully_shard`` runs FSDP2's schedule: nothing
    ahead in forward, the unit before in backward (blocks.1 is gathered before blocks.2 is
    resharded) — the same order of unit states, event for event."""
    theirs = pools(2).run(unit_states, "torch")[0]
    ours = pools(2).run(unit_states, "ours")[0]
    assert ours == theirs
    assert theirs.index(("blocks.1", "unsharding"), theirs.index(("blocks.2", "unsharded"), 12)) < \
        theirs.index(("blocks.2", "sharded"), 12)
