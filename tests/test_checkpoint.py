"""Sharded checkpoints: N ranks save under one strategy, M ranks load under another, bit-exact;
training resumes with the same losses; a save killed midway leaves the previous checkpoint; the
export equals single-process weights within a bounded buffer; bad input is named and changes
nothing; the reshard plan is what load reads, and is computable without ranks."""
import hashlib
import json
import math
import os
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch

from minishard import checkpoint
from minishard.checkpoint import CheckpointError
from minishard.core.comm import Comm
from minishard.core.launch import RankError, Ranks
from minishard.core.model import GPT, batch, config
from minishard.training.loop import TrainConfig, train
from minishard.viz import reshard_figure

import checkpoint_tasks
from minishard.training.parity import drift
from parity import initial, reference

NANO = config("nano")

# saved world size -> checkpoints (name, strategy, precision) its pool writes
SAVES = {1: [("n1_single", "single", "fp32")],
         2: [("n2_zero1", "zero1", "fp32"), ("n2_fsdp", "fsdp", "fp32"),
             ("n2_zero1_bf16", "zero1", "bf16_mixed")],
         3: [("n3_zero2", "zero2", "fp32"), ("n3_fsdp_flat", "fsdp_flat", "fp32")],
         4: [("n4_ddp", "ddp", "fp32"), ("n4_fsdp", "fsdp", "fp32")],
         8: [("n8_fsdp", "fsdp", "fp32"), ("n8_zero1", "zero1", "fp32")]}
LOADERS = ("fsdp", "zero1", "fsdp_flat", "ddp", "zero2")


def _loads(M: int) -> list:
    """Each checkpoint under three strategies (two on 8 ranks sharing 2 cores), rotating with M
    so that across the world sizes every saved strategy meets every loading one; 'single' too on
    one rank."""
    out = []
    for i, (name, _, precision) in enumerate(x for runs in SAVES.values() for x in runs):
        strategies = tuple(LOADERS[(i + M + k) % 5] for k in range(2 if M == 8 else 3))
        if precision == "bf16_mixed":           # bf16 working weights under an fp32 master
            strategies = ("zero1", "fsdp", "ddp") if M < 8 else ("zero2",)
        out += [(name, s, precision) for s in strategies + (("single",) if M == 1 else ())]
    return out


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Whole tensors from the ranks' ``{name: [(start, dtype, bytes)]}``; replicated elements must agree
    across ranks, and every element must be held by some rank."""
    parts: dict[str, list] = {}
    for dump in per_rank:
        for name, ps in dump.items():
            parts.setdefault(name, []).extend(
                (s, torch.frombuffer(bytearray(b), dtype=getattr(torch, d))) for s, d, b in ps)
    full, seen = {}, {}
    for name, ps in parts.items():
        n = max(s + v.numel() for s, v in ps)
        t = full[name] = torch.zeros(n, dtype=ps[0][1].dtype)
        mask = seen[name] = torch.zeros(n, dtype=torch.bool)
        for s, v in ps:
            old, both = t[s:s + v.numel()], mask[s:s + v.numel()]
            assert torch.equal(old[both], v[both]), f"{name}: replicas disagree"
            old.copy_(v)
            both.fill_(True)
    for name, mask in seen.items():
        assert mask.all(), f"{name}: elements held by no rank"
    return full


def _flat(tensors: dict) -> dict:
    return {n: t.reshape(-1) for n, t in tensors.items()}


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory):
    """Every checkpoint of SAVES, written by real ranks, and what the savers held."""
    root = tmp_path_factory.mktemp("ckpt")
    held = {}
    for N, runs in SAVES.items():
        per_rank = pools(N).run(checkpoint_tasks.save_runs, str(root), runs)
        for name, _, _ in runs:
            held[name] = assemble([r[name] for r in per_rank])
    return root, held


def test_reshard_n_to_m_bit_exact_across_strategies(pools, saved):
    root, held = saved
    pairs: set = set()
    for name, tensors in held.items():                     # the files hold what the ranks held
        on_disk = _flat(checkpoint.read_full(root / name))
        assert on_disk.keys() == tensors.keys()
        assert all(torch.equal(on_disk[n], tensors[n]) for n in tensors), name
    strategy_of = {name: s for runs in SAVES.values() for name, s, _ in runs}
    for M in SAVES:
        results = pools(M).run(checkpoint_tasks.load_runs, str(root), _loads(M))
        for k, (name, strategy, precision) in enumerate(_loads(M)):
            per_rank = [r[k] for r in results]
            what = f"{name} -> {M} ranks x {strategy}"
            # every rank holds exactly the checkpoint's values (model, optimizer state, and the
            # bf16 working copies of an fp32 master), and together they hold every element
            assert all(not r["wrong"] for r in per_rank), (what, per_rank[0]["wrong"][:3])
            covered: dict[str, list] = {}
            for r in per_rank:
                for n, spans in r["cover"].items():
                    covered.setdefault(n, []).extend(spans)
            assert covered.keys() == held[name].keys(), what
            for n, spans in covered.items():
                at = 0
                for s, c in sorted(spans):
                    assert s <= at, f"{what}: {n} elements {at}..{s} not loaded"
                    at = max(at, s + c)
                assert at == held[name][n].numel(), f"{what}: {n} not fully loaded"
            assert all(r["steps"] == {2.0} and r["step"] == 2 and r["lr"] == 1e-3 for r in per_rank)
            if precision == "bf16_mixed" and strategy != "fsdp":
                assert all(r["casts"] > 0 for r in per_rank), what     # the copies were checked
            pairs.add((int(name[1]), M, strategy_of[name], strategy))
    assert {(n, m) for n, m, *_ in pairs} == {(n, m) for n in SAVES for m in SAVES}
    crosses = {(a, b) for *_, a, b in pairs}
    for cross in [("zero1", "fsdp"), ("fsdp", "zero1"), ("ddp", "fsdp_flat"), ("fsdp_flat", "ddp")]:
        assert cross in crosses, cross


def test_plan_is_what_load_reads_and_needs_no_ranks(pools, saved):
    """The plan, from metadata alone, against what the loads actually asked each file for
    (recorded at safetensors' boundary): the same bytes; every element a rank holds was read;
    and nothing beyond the checksum blocks that cover it (at most a block each side of a piece)."""
    root, _ = saved
    meta = checkpoint.read_metadata(root / "n4_fsdp")
    start = {(p["file"], p["key"]): p["start"] for t in meta["tensors"].values() for p in t["pieces"]}
    block_bytes = meta["block_bytes"]
    for M, strategy in ((3, "zero2"), (2, "fsdp_flat")):
        loads = [("n4_fsdp", strategy, "fp32")]
        real = [r[0] for r in pools(M).run(checkpoint_tasks.load_runs, str(root), loads)]
        p = checkpoint.plan(meta, strategy, M, NANO)
        assert p.bytes_read() == [sum((hi - lo) * size for _, _, lo, hi, size in r["file_reads"])
                                  for r in real]
        for r in real:
            got: dict[str, list] = {}
            for file, key, lo, hi, _ in r["file_reads"]:
                name = next(n for n, t in meta["tensors"].items()
                            if any(q["file"] == file and q["key"] == key for q in t["pieces"]))
                got.setdefault(name, []).append((start[file, key] + lo, start[file, key] + hi))
            needed = 0
            for name, spans in r["cover"].items():            # every held element was read
                for s, n in spans:
                    needed += 4 * n
                    assert any(a <= s and s + n <= b for a, b in _merged(got[name])), (name, s, n)
            pieces = len(r["file_reads"])
            read = sum((hi - lo) * size for _, _, lo, hi, size in r["file_reads"])
            assert needed <= read <= needed + 2 * block_bytes * pieces
        assert all(r >= n for r, n in zip(p.bytes_read(), p.needed_bytes))
    # the metadata a save would write, computed from the layout math, is the real one (less checksums)
    imagined = checkpoint.layout_metadata("zero2", 3, NANO, step=2)
    real = checkpoint.read_metadata(root / "n3_zero2")
    assert imagined["files"] == real["files"]
    for name, t in real["tensors"].items():
        assert [{k: v for k, v in p.items() if k != "checksums"} for p in t["pieces"]] == \
            imagined["tensors"][name]["pieces"], name


@pytest.mark.parametrize("layout", ["per_param", "flat"])
def test_parameters_an_fsdp_unit_keeps_whole_are_saved_and_resharded(pools, tmp_path, layout):
    """``replicate_params``: the norms every rank holds whole are in the checkpoint (once), and
    3 ranks under ZeRO-1 load every element of it."""
    held = assemble(pools(2).run(checkpoint_tasks.save_with_replicated_norms, str(tmp_path / "norms"), layout))
    on_disk = _flat(checkpoint.read_full(tmp_path / "norms"))
    assert on_disk.keys() == held.keys() and "param/blocks.0.ln1.weight" in on_disk
    assert "exp_avg/ln_f.bias" in on_disk
    assert all(torch.equal(on_disk[n], held[n]) for n in held)
    for r in pools(3).run(checkpoint_tasks.load_runs, str(tmp_path), [("norms", "zero1", "fp32")]):
        assert not r[0]["wrong"] and r[0]["steps"] == {2.0}
    assert checkpoint.read_metadata(tmp_path / "norms")["strategy"] == ("fsdp" if layout == "per_param" else "fsdp_flat")


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(x) for x in out]


def test_64_ranks_resharded_to_32_from_metadata_alone():
    cfg = config("nano", seq_len=64)         # every dim 0 now divides by 64 (positions: 64 rows)
    meta = checkpoint.layout_metadata("fsdp", 64, cfg)
    assert len(meta["files"]) == 64
    p = checkpoint.plan(meta, "fsdp", 32)
    # new rank r's rows are exactly saved ranks 2r and 2r+1's rows
    assert p.files_read() == [[2 * r, 2 * r + 1] for r in range(32)]
    data = sum(info["bytes"] for info in meta["files"].values())
    assert sum(p.bytes_read()) == sum(p.needed_bytes) <= data        # each byte read once
    # the figure against the metadata: new rank r reads the whole files of saved ranks 2r, 2r+1
    fig = reshard_figure(p)
    assert len(fig.data[0].z) == 32
    in_file: dict[str, int] = {}                # bytes of every piece each saved rank wrote
    for t in meta["tensors"].values():
        for q in t["pieces"]:
            in_file[q["file"]] = in_file.get(q["file"], 0) + q["numel"] * 4
    for r, row in enumerate(fig.data[0].z):
        for s, z in enumerate(row):
            pieces = in_file.get(f"rank{s}.safetensors", 0)
            assert z == pytest.approx(pieces / 2**20 if s in (2 * r, 2 * r + 1) else 0, abs=1e-12), (r, s)
    assert "64 → 32" in fig.layout.title.text
    # under ZeRO-1 the parameters are replicas: every new rank reads from every file
    z = checkpoint.plan(meta, "zero1", 32)
    assert all(len(f) == 64 for f in z.files_read())


def _all_bytes(meta: dict) -> int:
    """Every element of every tensor the checkpoint holds, in bytes, from the shapes and dtypes."""
    return sum(math.prod(t["shape"]) * checkpoint.format.element_size(t["dtype"])
               for t in meta["tensors"].values())


def test_the_plan_of_an_sgd_momentum_checkpoint_reads_the_momentum_too(tmp_path):
    """The plan guesses the optimizer from the state kinds the checkpoint holds; guessing plain
    SGD for a momentum checkpoint would plan half of what the load really reads."""
    net = GPT(NANO, seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x, y = batch(NANO, 0, 2)
    net(x, y).backward()
    opt.step()
    checkpoint.save(net, opt, tmp_path / "ck", comm=Comm(), step=1)
    meta = checkpoint.read_metadata(tmp_path / "ck")
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    assert _all_bytes(meta) == 2 * params                 # the weights and their momentum
    p = checkpoint.plan(meta, "single", 1)
    assert p.needed_bytes == [2 * params] and p.bytes_read() == [2 * params]
    assert {rd.tensor.split("/")[0] for rd in p.reads[0]} == {"param", "momentum_buffer"}
    target = GPT(NANO, seed=1)
    topt = torch.optim.SGD(target.parameters(), lr=0.05, momentum=0.9)
    assert checkpoint.load(target, topt, tmp_path / "ck", comm=Comm())["bytes_read"] == 2 * params


def test_the_bf16_working_copies_add_nothing_to_what_a_rank_needs(tmp_path):
    """Under bf16_mixed the bf16 weights are rounded from the fp32 master the checkpoint holds,
    never read: what a DDP rank needs is the checkpoint's every byte, no more (the reshard figure
    compares it with what is read: counting the copies would show reads below the need)."""
    meta = checkpoint.layout_metadata("single", 1, NANO, precision="bf16_mixed")
    total = _all_bytes(meta)
    params = sum(p.numel() for p in GPT(NANO, device="meta").parameters())
    assert total == 3 * 4 * params                        # fp32 master, exp_avg, exp_avg_sq
    assert any(g.cast for g in checkpoint.layout("ddp", 0, 2, NANO, precision="bf16_mixed").regions)
    for precision in ("bf16_mixed", "fp32"):
        p = checkpoint.plan(meta, "ddp", 2, precision=precision)
        assert p.needed_bytes == [total, total] == p.bytes_read(), precision


def test_training_continues_with_identical_losses(pools, tmp_path):
    kw = dict(model="nano", track_activations=False, return_params=True)
    ck = str(tmp_path / "run")
    whole = pools(4).run(train, TrainConfig(strategy="fsdp", steps=4, micro_batch=3, **kw))
    pools(4).run(train, TrainConfig(strategy="fsdp", steps=2, micro_batch=3, save_to=ck, **kw))
    same = pools(4).run(train, TrainConfig(strategy="fsdp", steps=2, micro_batch=3, resume_from=ck, **kw))
    assert [o["losses"] for o in same] == [o["losses"][2:] for o in whole]      # bitwise
    assert all(torch.equal(same[0]["params"][n], whole[0]["params"][n]) for n in whole[0]["params"])
    want = [sum(o["losses"][s] for o in whole) / 4 for s in (2, 3)]
    # the same global batch of 12 sequences on 2, 3 (uneven: 3 divides no parameter) and 1 ranks
    for M, strategy in ((2, "zero1"), (3, "fsdp_flat"), (3, "ddp"), (1, "single")):
        if M == 1:
            out = [train(None, TrainConfig(strategy=strategy, steps=2, micro_batch=12, resume_from=ck, **kw))]
        else:
            out = pools(M).run(train, TrainConfig(strategy=strategy, steps=2, micro_batch=12 // M, resume_from=ck, **kw))
        assert out[0]["checkpoint"]["load"]["step"] == 2
        got = [sum(o["losses"][s] for o in out) / M for s in range(2)]
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, want)), (M, strategy, got, want)
        # another world size sums in another order: the parity measure (docs/testing.md)
        d = drift(out[0]["params"], whole[0]["params"], initial("nano"))
        assert d.within(2e-3), (M, strategy, d)


def _digest(path: Path) -> dict:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("task", ["save_then_die", "background_save_then_die"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, task):
    """Synchronous, or in the background (rank 1 killed while its thread writes)."""
    ck = tmp_path / "run"
    with Ranks(2, timeout=120) as own:          # its own pool: a rank is killed on purpose
        # rank 1 dies; whichever rank the pool hears from first (rank 1's exit code -9, or rank
        # 0's "connection closed" in the collective after the write), the save failed
        with pytest.raises(RankError, match="code -9|Connection|closed|reset"):
            own.run(getattr(checkpoint_tasks, task), str(ck), 1)
    assert (tmp_path / ".run.saving").exists()             # the half-written new one, aside
    assert checkpoint.read_metadata(ck)["step"] == 2        # the previous one, untouched
    before = _digest(ck)
    reloaded = train(None, TrainConfig(strategy="single", model="nano", steps=1, micro_batch=4, resume_from=str(ck), track_activations=False, save_to=str(ck)))  # loads, trains, saves again
    assert reloaded["checkpoint"]["load"]["saved_world_size"] == 2
    assert checkpoint.read_metadata(ck)["step"] == 3
    assert not (tmp_path / ".run.saving").exists() and _digest(ck) != before
    # the dead save's leftovers (rank 1's partial file) did not move in with the new checkpoint
    assert sorted(f.name for f in ck.iterdir()) == ["metadata.json", "rank0.safetensors"]


def test_when_one_rank_fails_every_rank_raises_its_error_and_nothing_changes(pools, tmp_path):
    """Saves and loads agree: a failure on rank 1 alone makes rank 0 raise the same error, the
    failed save leaves no checkpoint behind, the failed load leaves every model as it was."""
    res = pools(2).run(checkpoint_tasks.one_rank_fails, str(tmp_path / "ck"), 1)
    for r in res:
        assert r["save"] is not None and "planted failure on rank 1" in r["save"]
        assert r["load"] is not None and "planted failure on rank 1" in r["load"]
        assert r["unchanged"] and not r["again_exists"]


def test_export_equals_single_process_weights(pools, tmp_path):
    kw = dict(model="nano", steps=2, track_activations=False, return_params=True)
    single = train(None, TrainConfig(strategy="single", micro_batch=4, save_to=str(tmp_path / "one"), **kw))
    ranks = pools(2).run(train, TrainConfig(strategy="fsdp_flat", micro_batch=2, save_to=str(tmp_path / "two"), **kw))
    for ck, params, exact in ((tmp_path / "one", single["params"], True),
                              (tmp_path / "two", ranks[0]["params"], True),
                              (tmp_path / "two", single["params"], False)):
        out = tmp_path / f"export-{ck.name}"
        report = checkpoint.export(ck, out)
        model = GPT(NANO, seed=7)
        model.load_state_dict(checkpoint.load_exported(out), strict=True)
        got = {n: p.detach() for n, p in model.named_parameters()}
        if exact:                            # the export copies the bytes it read
            assert all(torch.equal(got[n], params[n]) for n in params)
        else:                                # 2 ranks vs one process: summation order only
            d = drift(got, params, initial("nano"))
            assert d.within(2e-3), d
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) == NANO.n_layer + 1     # a file per block + rest
        assert set(index["weight_map"]) == set(params)
        assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in params.values())
        assert report["peak_buffer_bytes"] <= 2 * report["largest_tensor_bytes"]
    ref = reference(2, 2, model="nano", steps=2)
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in
               zip([sum(r["losses"][s] for r in ranks) / 2 for s in range(2)], ref["losses"]))
    half = checkpoint.export(tmp_path / "two", tmp_path / "bf16", dtype=torch.bfloat16)
    assert half["total_size"] * 2 == report["total_size"]
    assert torch.equal(checkpoint.load_exported(tmp_path / "bf16")["head.weight"],
                       ranks[0]["params"]["head.weight"].to(torch.bfloat16))


# ---------------------------------------------------------------------- bad input, one process

_model = checkpoint_tasks.one_process_model


def _fingerprint(net, opt) -> str:
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().float().numpy().tobytes())
        for v in opt.state.get(p, {}).values():
            h.update(v.float().numpy().tobytes())
    return h.hexdigest()


def _broken(good: Path, where: Path, how) -> Path:
    shutil.copytree(good, where)
    how(where)
    return where


def test_bad_input_is_named_and_changes_nothing(tmp_path, monkeypatch):
    comm = Comm()                                         # one process, no process group
    net, opt = _model()
    good = tmp_path / "good"
    checkpoint.save(net, opt, good, comm=comm, step=1)
    digest = _digest(good)
    target, topt = _model(seed=3)
    before = _fingerprint(target, topt)

    def flip(d):                                          # one byte in the middle of the data
        f = d / "rank0.safetensors"
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0xFF
        f.write_bytes(bytes(b))

    def bump_version(d):
        m = json.loads((d / "metadata.json").read_text())
        m["version"] = checkpoint.VERSION + 1
        (d / "metadata.json").write_text(json.dumps(m))

    cases = [
        (lambda d: (d / "rank0.safetensors").unlink(), r"missing shard file \S*rank0.safetensors: it holds param/"),
        (flip, r"rank0.safetensors: checksum mismatch in \w+/[\w.]+, elements \[\d+, \d+\)"),
        (lambda d: os.truncate(d / "rank0.safetensors", 5000), r"rank0.safetensors is 5,000 bytes.*truncated.*param/"),
        (bump_version, rf"metadata.json has format version {checkpoint.VERSION + 1}; this minishard reads versions 1, 2"),
    ]
    for k, (how, message) in enumerate(cases):
        with pytest.raises(CheckpointError, match=message):
            checkpoint.load(target, topt, _broken(good, tmp_path / f"bad{k}", how), comm=comm)
        assert _fingerprint(target, topt) == before       # nothing overwritten
    for overrides, message in [
        (dict(n_layer=2), r"metadata.json: parameter names do not match — the model lacks \['blocks.2.attn.proj.bias'"),
        (dict(d_model=32), r"metadata.json: tok_emb.weight has shape \[512, 32\] in the model, \[512, 64\]"),
    ]:
        other, oopt = _model(**overrides)
        with pytest.raises(CheckpointError, match=message):
            checkpoint.load(other, oopt, good, comm=comm)
    half = GPT(NANO).to(torch.bfloat16)
    with pytest.raises(CheckpointError, match="dtype mismatch for param/tok_emb.weight: saved as float32, "
                                              "the model holds bfloat16"):
        checkpoint.load(half, None, good, comm=comm)
    sgd = torch.optim.SGD(target.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="saved by AdamW does not fit this SGD.*optimizer=None"):
        checkpoint.load(target, sgd, good, comm=comm)
    checkpoint.load(target, None, good, comm=comm)        # weights only: fine
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), net.parameters()))

    # the target directory: not creatable, not ours, full, or filling up during the write
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"cannot create the checkpoint directory \S*a_file"):
        checkpoint.save(net, opt, blocker / "ck", comm=comm, step=1)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="notes exists and is not a minishard checkpoint"):
        checkpoint.save(net, opt, tmp_path / "notes", comm=comm, step=1)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    other, oopt = _model(seed=5)
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: real_usage(p)._replace(free=1 << 20))
    with pytest.raises(CheckpointError, match=r"has 1.0 MiB free; the checkpoint needs 2.\d MiB"):
        checkpoint.save(other, oopt, good, comm=comm, step=9)
    monkeypatch.setattr(shutil, "disk_usage", real_usage)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))     # the disk fills up mid-file
    try:
        with pytest.raises(CheckpointError, match=r"cannot write \S*rank0.safetensors \(pieces of "
                                                  r"param/tok_emb.weight .*File too large"):
            checkpoint.save(other, oopt, good, comm=comm, step=9)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert _digest(good) == digest                        # the previous checkpoint, untouched
    assert not (tmp_path / ".good.saving").exists()
    checkpoint.load(target, topt, good, comm=comm)
    assert _fingerprint(target, topt) == _fingerprint(net, opt)


def test_a_load_restores_the_learning_rate_a_schedule_had_set(tmp_path):
    """A scheduler changes the optimizer's lr (and a user its betas) as training goes; resuming
    with the constructor's values instead would jump the schedule back to its start."""
    net, opt = _model()
    opt.param_groups[0].update(lr=2.5e-4, betas=(0.8, 0.95), weight_decay=0.03)
    checkpoint.save(net, opt, tmp_path / "ck", comm=Comm(), step=1)
    target, topt = _model(seed=3)
    assert topt.param_groups[0]["lr"] == 1e-3
    checkpoint.load(target, topt, tmp_path / "ck", comm=Comm())
    group = topt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (2.5e-4, (0.8, 0.95), 0.03)


# ---------------------------------------------------------------------- the protocol

class Packed(torch.nn.Module):
    """A strategy of its own: two weights packed in one flat parameter, which it describes
    itself (``checkpoint_regions``) as the global tensors ``a`` (2x3) and ``b`` (4,)."""

    def __init__(self, seed: int):
        super().__init__()
        self.flat = torch.nn.Parameter(torch.randn(10, generator=torch.Generator().manual_seed(seed)))

    def checkpoint_regions(self, holdings) -> None:
        holdings.strategy, holdings.order = "packed", ["a", "b"]
        flat = self.flat.detach()
        for name, shape, view in (("a", (2, 3), flat[:6]), ("b", (4,), flat[6:])):
            holdings.tensor(f"param/{name}", shape, flat.dtype)
            holdings.add_replica(f"param/{name}", view)


def test_a_strategy_that_describes_its_own_regions_is_saved_and_loaded_without_an_adapter(tmp_path):
    comm = Comm()
    src, dst = Packed(seed=1), Packed(seed=2)
    assert isinstance(src, checkpoint.CheckpointRegions)
    checkpoint.save(src, None, tmp_path / "ck", comm=comm, step=1)
    meta = checkpoint.read_metadata(tmp_path / "ck")
    assert meta["strategy"] == "packed" and list(meta["tensors"]) == ["param/a", "param/b"]
    full = checkpoint.read_full(tmp_path / "ck")
    assert torch.equal(full["param/a"], src.flat.detach()[:6].view(2, 3))
    assert torch.equal(full["param/b"], src.flat.detach()[6:])
    checkpoint.load(dst, None, tmp_path / "ck", comm=comm)
    assert torch.equal(dst.flat, src.flat)


def test_pytorchs_own_sharded_states_are_refused_with_a_way_out(pools):
    for answer in pools(2).run(checkpoint_tasks.refusals):
        assert "ZeroRedundancyOptimizer keeps its own layout" in answer["torch_zero1"]
        assert "fully_shard (DTensor) parameters: use torch.distributed.checkpoint" in answer["torch_fsdp"]
