"""ZeRO-3 / FSDP: units gather just in time, train exactly like one process, move 3 passes of
parameters instead of DDP's 2, and peak at the shards + one gathered unit + activations."""
import pytest
import torch

from minishard.strategies import fsdp
from minishard.core.comm import Comm
from minishard.planner.analytic import gpt_activation_bytes
from minishard.core.model import GPT, batch, config
from minishard.training.loop import TrainConfig, train

from parity import as_reference, assert_parity, reference
import rank_tasks

STEPS, MB = 3, 2
NANO = dict(model="nano", steps=STEPS)
STRATS = ("fsdp", "fsdp_flat")                 # per-parameter (FSDP2) and flat (FSDP1) layouts


@pytest.mark.parametrize("N", [1, 2, 3, 4])
def test_fsdp_matches_single_process_ddp_and_torch_fsdp2(pools, N):
    pool = pools(N)
    ref = reference(N, MB, **NANO)
    ddp = pool.run(train, TrainConfig(strategy="ddp", micro_batch=MB, return_params=True, **NANO))
    torch_fsdp = pool.run(train, TrainConfig(strategy="torch_fsdp", micro_batch=MB, return_params=True, **NANO))
    assert_parity(torch_fsdp, ref)
    for strategy in STRATS:
        ours = pool.run(train, TrainConfig(strategy=strategy, micro_batch=MB, return_params=True, **NANO))
        assert_parity(ours, ref)
        # on 2 ranks a sum has one order: ZeRO-3 gives DDP's bits exactly
        assert_parity(ours, as_reference(ddp, ref["init"]),
                      **(dict(loss_rtol=0, bitwise=True) if N <= 2 else {}))


@pytest.mark.parametrize("N", [2, 3])
def test_both_layouts_train_bit_identically(pools, N):
    a = pools(N).run(train, TrainConfig(strategy="fsdp", micro_batch=MB, return_params=True, **NANO))
    b = pools(N).run(train, TrainConfig(strategy="fsdp_flat", micro_batch=MB, return_params=True, **NANO))
    assert [r["losses"] for r in a] == [r["losses"] for r in b]
    assert all(torch.equal(a[0]["params"][k], b[0]["params"][k]) for k in a[0]["params"])


@pytest.mark.parametrize("N", [2, 4])
@pytest.mark.parametrize("options", [
    dict(accum=3),                                        # reduce-scatter every micro-batch
    dict(accum=3, no_sync=True),                          # keep full grads, one reduce-scatter
    dict(freeze=("pos_emb", "blocks.0.ln1", "blocks.1.mlp.fc.bias")),
    dict(recompute=True),                                 # activation checkpointing
    dict(reshard_after_forward=False),
    dict(wrap="linear"), dict(wrap="model"), dict(reshard_root=True),
], ids=lambda o: "-".join(o))
def test_fsdp_options_keep_sgd_parity_tight(pools, N, options):
    options = dict(options)
    no_sync = options.pop("no_sync", False)
    kw = dict(NANO, optimizer="sgd_momentum", lr=0.05, **options)
    ours = pools(N).run(train, TrainConfig(strategy="fsdp", micro_batch=MB, return_params=True, accumulation="no_sync" if no_sync else None, **kw))
    assert_parity(ours, reference(N, MB, **kw))
    if "freeze" not in options and "wrap" not in options:
        flat = pools(N).run(train, TrainConfig(strategy="fsdp_flat", micro_batch=MB, return_params=True, accumulation="no_sync" if no_sync else None, **kw))
        assert_parity(flat, reference(N, MB, **kw))


def test_flat_layout_refuses_frozen_and_trainable_in_one_unit(pools):
    with pytest.raises(Exception, match="cannot mix frozen and trainable"):
        train(None, TrainConfig(strategy="fsdp_flat", model="nano", steps=1, freeze=("blocks.0.ln1",)))


def test_lifecycle_order_of_a_3_block_model(pools):
    """The exact sequence of unit states and collectives in one step (as PyTorch's FSDP tests
    assert): gather before compute, free after forward, gather again in backward, reduce-scatter,
    free; the root stays gathered from its forward to the end of backward."""
    def unit(u, backward):
        steps = [f"{u}:unsharding", f"all_gather({u})", f"{u}:unsharded"]
        return steps + ([f"{u}:reduce_scattering", f"reduce_scatter({u})"] if backward else []) \
            + [f"{u}:sharded"]
    expected = (["FORWARD", "root:unsharding", "all_gather(root)", "root:unsharded"]
                + unit("blocks.0", False) + unit("blocks.1", False) + unit("blocks.2", False)
                + ["BACKWARD"] + unit("blocks.2", True) + unit("blocks.1", True)
                + unit("blocks.0", True)
                + ["root:reduce_scattering", "reduce_scatter(root)", "root:sharded", "OPTIMIZER"])
    for layout in ("per_param", "flat"):
        for got in pools(2).run(rank_tasks.fsdp_lifecycle, layout):
            assert got == expected


def test_manual_mode_walks_the_same_lifecycle_by_hand(pools):
    assert all(pools(3).run(rank_tasks.fsdp_manual_vs_hooks))


def _shard_elements(N: int, strategy: str) -> list[int]:
    """Elements one rank stores of each unit of the nano GPT (blocks, then the root): each
    parameter's rows padded to a multiple of N (per-parameter), or each unit's flat buffer."""
    import math
    net = GPT("nano", device="meta")
    units = [list(b.parameters()) for b in net.blocks]
    units.append([p for n, p in net.named_parameters() if not n.startswith("blocks.")])
    if strategy == "fsdp_flat":
        return [math.ceil(sum(p.numel() for p in u) / N) for u in units]
    return [sum(math.ceil(p.shape[0] / N) * (p.numel() // p.shape[0]) for p in u) for u in units]


@pytest.mark.parametrize("N", [2, 3, 4])
def test_zero3_sends_1_5x_ddp_bytes(pools, N):
    """Textbook ZeRO-3 (every unit, root included, gathered in forward and again in backward,
    gradients reduce-scattered): 3 (N-1)/N Psi against DDP's 2 (N-1)/N Psi. FSDP2's default
    keeps the root gathered between forward and backward and saves one pass of its parameters."""
    kw = dict(model="nano", steps=1, micro_batch=1, track_activations=False)
    pool = pools(N)
    ddp = pool.run(train, TrainConfig(strategy="ddp", **kw))[0]["wire"][0]
    for strategy in STRATS:
        textbook = pool.run(train, TrainConfig(strategy=strategy, reshard_root=True, **kw))
        default = pool.run(train, TrainConfig(strategy=strategy, **kw))[0]
        per_unit = _shard_elements(N, strategy)
        per_rank = sum(per_unit)                                 # 1/N of every unit, padded
        assert textbook[0]["wire"][0] == 3 * (N - 1) * 4 * per_rank
        assert ddp == 2 * (N - 1) * 4 * 217_664 // N
        ratio = textbook[0]["wire"][0] / ddp
        assert abs(ratio - 1.5 * N * per_rank / 217_664) < 1e-6  # 1.5x, times the padding
        assert abs(ratio - 1.5) < 0.02
        by_op = textbook[0]["by_op"]
        assert by_op["all_gather"]["wire"] == 2 * by_op["reduce_scatter"]["wire"]
        # FSDP2's default skips one all-gather: the root's, in backward
        assert textbook[0]["wire"][0] - default["wire"][0] == (N - 1) * 4 * per_unit[-1]
        for r in textbook:                                       # and the OS agrees
            assert 0 <= r["wchar"][0] - r["wire"][0] <= 8192 + 0.001 * r["wire"][0]


@pytest.mark.parametrize("N", [2, 3, 4])
@pytest.mark.parametrize("strategy", STRATS)
def test_fsdp_peak_is_shards_plus_the_largest_unit_plus_activations(pools, N, strategy):
    """With activations dominating (micro-batch 4), the peak comes at the end of forward:
    16 Psi/N of sharded state (fp32 AdamW: params, grads, m, v) + the root unit's full
    parameters (the largest unit: embeddings and head) + every activation."""
    cfg = config("tiny")
    res = pools(N).run(train, TrainConfig(strategy=strategy, model="tiny", steps=2, micro_batch=4))
    root_params = cfg.vocab_size * cfg.d_model * 2 + cfg.seq_len * cfg.d_model + 2 * cfg.d_model
    for r in res:
        led = r["ledger"]
        state = sum(v for c, v in led["estimate"].items() if c != "activations")
        # 16 Psi / N, padded: by the layout, at most one row of each tensor (the formula counts it)
        rows = sum(p.numel() // p.shape[0] for p in GPT(cfg, device="meta").parameters())
        assert 0 <= state - 16 * 6_868_992 / N < 16 * rows
        formula = state + 4 * root_params + gpt_activation_bytes(cfg, 4)
        assert abs(led["peak"] - formula) <= 0.02 * formula, (led["peak"], formula)


def test_wrap_granularity_sweep(pools):
    """One unit for the whole model gathers everything at once; one unit per Linear explodes the
    number of collectives; one per block sits between."""
    kw = dict(model="nano", steps=2, micro_batch=2, track_activations=False)
    res = {w: pools(2).run(train, TrainConfig(strategy="fsdp", wrap=w, **kw))[0] for w in ("model", "block", "linear")}
    unsharded = {w: r["ledger"]["peak_snapshot"].get("unsharded", 0) for w, r in res.items()}
    calls = {w: r["calls"][-1] for w, r in res.items()}
    assert unsharded["model"] == 4 * 217_664 > unsharded["block"] > unsharded["linear"]
    assert calls["model"] < calls["block"] < calls["linear"]
    assert calls["linear"] >= 3 * 3 * 4                       # 4 Linears per block, 3 blocks


def test_bad_input_is_named():
    comm = Comm()
    net = GPT("nano")
    fsdp.fully_shard(net.blocks[0], comm=comm)
    with pytest.raises(ValueError, match="already an FSDP unit"):
        fsdp.fully_shard(net.blocks[0], comm=comm)
    with pytest.raises(ValueError, match="unknown layout"):
        fsdp.fully_shard(net.blocks[1], comm=comm, layout="diagonal")
    tied = GPT("nano")
    tied.head.weight = tied.tok_emb.weight
    with pytest.raises(ValueError, match="tied weights"):
        fsdp.fully_shard(tied, comm=comm)
    tied2 = GPT("nano")
    tied2.head.weight = tied2.blocks[0].attn.proj.weight
    fsdp.fully_shard(tied2.blocks[0], comm=comm)
    with pytest.raises(ValueError, match="shared with unit"):
        fsdp.fully_shard(tied2, comm=comm)
    late = GPT("nano")
    fsdp.fully_shard(late.blocks[0], comm=comm)
    fsdp.fully_shard(late, comm=comm)
    late(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="before the first forward"):
        fsdp.fully_shard(torch.nn.Sequential(late), comm=comm, name="outer")


@pytest.mark.parametrize("shard_size", [2, 1, 4])
def test_hybrid_sharding_on_2_nodes_of_2_ranks(pools, shard_size):
    """HSDP: shard inside a "node" of ``shard_size`` ranks, replicate across nodes. Same
    training; the sharding collectives stay inside a node, and only the gradient shards cross."""
    kw = dict(NANO, optimizer="sgd_momentum", lr=0.05)
    res = pools(4).run(train, TrainConfig(strategy="hsdp", shard_size=shard_size, micro_batch=MB, return_params=True, **kw))
    assert_parity(res, reference(4, MB, **kw))
    by_op = res[0]["by_op"]
    if shard_size == 1:                     # pure replication: DDP by another name
        assert "all_gather" not in by_op or by_op["all_gather"]["wire"] == 0
    if 1 < shard_size < 4:                  # the cross-node all-reduce moves 1/shard_size
        state = 4 * 217_664
        assert by_op["all_reduce"]["payload"] == pytest.approx(STEPS * state / shard_size, rel=0.01)


def test_per_parameter_layout_keeps_each_dtype_exactly():
    """A unit with bf16 and fp32 parameters and no compute dtype: the gather moves raw bytes,
    so no parameter is rounded to another's dtype."""
    net = GPT("nano")
    block = net.blocks[0]
    block.ln1.to(torch.bfloat16)                      # the unit's first parameter is bf16
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    fsdp.fully_shard(block, comm=Comm(), manual=True, name="b0")
    unit = block._fsdp_unit
    unit.unshard()
    full = dict(zip([s.fqn for s in unit.layout.slots], unit.layout.full_values()))
    for name, value in before.items():
        assert full[name].dtype == value.dtype and torch.equal(full[name], value), name


# ---------------------------------------------------------------------------- the redesign's API

SGD = dict(model="nano", steps=3, optimizer="sgd", lr=0.5)
NORMS = {"blocks": ("ln1", "ln2"), "root": ("ln_f",)}


def replicated_norms_run(rank, layout: str, accum: int, no_sync: bool) -> dict:
    """Rank task: the nano GPT with every norm kept replicated (``replicate_params``), trained
    with plain SGD through ``train_step`` as the ``fsdp`` strategy would."""
    from minishard.strategies import get
    from minishard.strategies.fsdp.recipe import FSDPBuilt
    from minishard.training.loop import train_step
    cfg = config("nano")
    comm = Comm(rank.tracer)
    net = GPT(cfg, seed=0)
    fsdp.apply_fsdp(net, comm=comm, layout=layout, blocks=dict(replicate_params=NORMS["blocks"]),
                    root=dict(replicate_params=NORMS["root"]))
    opt = fsdp.ShardedOptimizer(net, torch.optim.SGD(net.parameters(), lr=SGD["lr"]))
    built = FSDPBuilt(get("fsdp"), net, opt, (comm,), accumulation="no_sync" if no_sync else None)
    comm.reset_counters()
    losses = [train_step(built, [batch(cfg, s * accum + k, MB, rank.rank, rank.world_size)
                                 for k in range(accum)]) for s in range(SGD["steps"])]
    whole = {n: p.detach().clone() for n, p in net.named_parameters() if ".ln" in n or n.startswith("ln_f")}
    return {"rank": rank.rank, "losses": losses, "params": built.full_parameters(), "whole": whole,
            "by_op": comm.by_op}


@pytest.mark.parametrize("N", [2, 3])
@pytest.mark.parametrize("layout", ["per_param", "flat"])
@pytest.mark.parametrize("accum,no_sync", [(1, False), (3, False), (3, True)])
def test_replicated_norms_train_like_one_process_whole_on_every_rank(pools, N, layout, accum, no_sync):
    """``replicate_params``: the norms are never sharded — every rank holds them whole and
    identical — their gradients are all-reduced (one packed all-reduce per unit and
    synchronisation, of exactly their bytes), and SGD trains exactly like one process."""
    res = pools(N).run(replicated_norms_run, layout, accum, no_sync)
    assert_parity(res, reference(N, MB, accum=accum, **SGD), rtol=1e-3)
    cfg = config("nano")
    for r in res:
        assert {n: tuple(t.shape) for n, t in r["whole"].items()} == \
            {n: tuple(t.shape) for n, t in res[0]["whole"].items()}
        assert all(t.shape == (cfg.d_model,) and torch.equal(t, res[0]["whole"][n])
                   for n, t in r["whole"].items())
    n_norm = 2 * 2 * cfg.d_model * cfg.n_layer + 2 * cfg.d_model       # ln1, ln2 per block; ln_f
    assert len(res[0]["whole"]) == 4 * cfg.n_layer + 2
    syncs = SGD["steps"] * (1 if no_sync else accum)
    ar = res[0]["by_op"]["all_reduce"]
    assert ar["payload"] == syncs * 4 * n_norm and ar["calls"] == syncs * (cfg.n_layer + 1)


def test_replicated_parameters_are_refused_where_they_cannot_work():
    net = GPT("nano")
    with pytest.raises(ValueError, match="no parameter or submodule \\['ln3'\\]"):
        fsdp.fully_shard(net.blocks[0], replicate_params=("ln3",))
    with pytest.raises(ValueError, match="param_dtype .*would compute in two dtypes"):
        fsdp.fully_shard(net.blocks[1], replicate_params=("ln1.weight",),      # (its bias sharded)
                         mp_policy=fsdp.MixedPrecisionPolicy(torch.bfloat16))


def master_gather_run(rank, layout: str) -> dict:
    """Rank task: one bf16-mixed step, then the full parameters in both dtypes."""
    from minishard.training.loop import build, train_step
    cfg = config("nano")
    comm = Comm(rank.tracer)
    built = build(GPT(cfg), TrainConfig("fsdp" if layout == "per_param" else "fsdp_flat",
                                        model="nano", precision="bf16_mixed"), comm)
    train_step(built, [batch(cfg, 0, MB, rank.rank, rank.world_size)])
    events = len(rank.tracer.events)
    master = fsdp.full_parameters(built.model, dtype=torch.float32)
    quiet = not [e for e in rank.tracer.events[events:] if e["kind"] == "unit"]
    compute = fsdp.full_parameters(built.model)
    shards = {}                        # this rank's shard values, by name (per-parameter layout)
    for u in fsdp.units(built.model) if layout == "per_param" else ():
        for s, t in zip(u.layout.slots, u.layout.sharded):
            shards[s.fqn if u.name == "root" else f"{u.name}.{s.fqn}"] = t.detach().clone()
    return {"master": master, "compute": compute, "quiet": quiet, "shards": shards, "rank": rank.rank}


@pytest.mark.parametrize("layout", ["per_param", "flat"])
def test_full_parameters_gather_the_fp32_master_or_the_compute_dtype(pools, layout):
    """Under bf16 mixed precision the shards are fp32 masters: ``dtype=torch.float32`` gathers
    them exactly (the unit's own state untouched: no unit event), the default gathers what
    the units compute with — the same values rounded to bf16."""
    res = pools(2).run(master_gather_run, layout)
    for r in res:
        assert r["quiet"]
        assert r["master"].keys() == r["compute"].keys()
        assert all(v.dtype == torch.float32 for v in r["master"].values())
        assert all(v.dtype == torch.bfloat16 for v in r["compute"].values())
        assert all(torch.equal(r["master"][k].to(torch.bfloat16), r["compute"][k]) for k in r["master"])
        assert any(not torch.equal(r["master"][k], r["compute"][k].float()) for k in r["master"])
        for name, shard in r["shards"].items():                  # rank r's rows, exactly
            c = shard.shape[0]
            mine = r["master"][name].reshape(-1, *shard.shape[1:])[r["rank"] * c:(r["rank"] + 1) * c]
            assert torch.equal(shard[:mine.shape[0]], mine), name
        assert all(torch.equal(r["master"][k], res[0]["master"][k]) for k in r["master"])


def default_comm_run(rank) -> dict:
    """Rank task: ``fully_shard`` without ``comm``: the default process group."""
    net = GPT("nano")
    for b in net.blocks:
        fsdp.fully_shard(b)
    fsdp.fully_shard(net)
    us = fsdp.units(net)
    for u in us:
        u.comm.reset_counters()
    net(*batch(config("nano"), 0, MB, rank.rank, rank.world_size)).backward()
    return {"world": {u.comm.world_size for u in us},
            "calls": [u.comm.totals["calls"] for u in us],
            "params": fsdp.full_parameters(net)}


def test_fully_shard_without_comm_uses_the_default_process_group(pools):
    res = pools(2).run(default_comm_run)
    for r in res:
        assert r["world"] == {2}
        # the root gathered once, each block twice; one reduce-scatter each
        assert r["calls"] == [2, 3, 3, 3]
        assert all(torch.equal(t, res[0]["params"][k]) for k, t in r["params"].items())


def test_training_state_says_what_each_unit_is_doing():
    """FORWARD while a unit computes forward; in backward, PRE_BACKWARD while it computes its
    gradients (blocks after it already POST_BACKWARD); IDLE and SHARDED after the step."""
    net = GPT("nano")
    fsdp.apply_fsdp(net)
    us = {u.name: u for u in fsdp.units(net)}
    seen = {}

    def grab(where: str) -> None:      # (a hook that returns None changes nothing)
        seen.setdefault(where, {n: u.training_state.value for n, u in us.items()})
    net.blocks[1].mlp.register_forward_hook(lambda *_: grab("forward of blocks.1"))
    net.blocks[1].mlp.register_full_backward_hook(lambda *_: grab("backward of blocks.1"))
    loss = net(*batch(config("nano"), 0, MB))
    grab("between forward and backward")
    loss.backward()
    assert seen["forward of blocks.1"] == {"root": "forward", "blocks.0": "idle",
                                           "blocks.1": "forward", "blocks.2": "idle"}
    assert set(seen["between forward and backward"].values()) == {"idle"}
    assert seen["backward of blocks.1"] == {"root": "pre_backward", "blocks.0": "idle",
                                            "blocks.1": "pre_backward", "blocks.2": "post_backward"}
    assert {(u.training_state, u.memory_state) for u in us.values()} == {
        (fsdp.TrainingState.IDLE, fsdp.MemoryState.SHARDED)}


def test_the_optimizer_steps_only_on_shards():
    """``ShardedOptimizer``: the step's place in the lifecycle is after backward, every unit
    sharded; a step while a unit holds its full parameters is refused."""
    net = GPT("nano")
    fsdp.fully_shard(net.blocks[0], manual=True, name="b0")
    opt = fsdp.ShardedOptimizer(net.blocks[0], torch.optim.SGD(net.blocks[0].parameters(), lr=0.1))
    unit = net.blocks[0]._fsdp_unit
    unit.unshard()
    with pytest.raises(RuntimeError, match="FSDP unit b0 is unsharded"):
        opt.step()
    unit.reshard()
    opt.step()


def test_every_hook_is_registered_in_hooks_py():
    """The hooks, and the autograd nodes and callbacks that act as hooks, are made in one file."""
    import ast
    from pathlib import Path
    registering = {"register_forward_pre_hook", "register_forward_hook", "register_hook",
                   "register_post_accumulate_grad_hook", "queue_callback", "apply"}
    where = {}
    for f in (Path(fsdp.__file__).parent).glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in registering:
                where.setdefault(node.func.attr, set()).add(f.name)
    assert where and all(files == {"hooks.py"} for files in where.values()), where


def test_calls_go_one_way_hooks_to_unit_to_context_and_layout():
    """The hooks call the unit; the unit never calls a hook (it does not import ``hooks``), and
    holds none of the root's fields: those live on the root's context (``state.py``)."""
    import ast
    from pathlib import Path
    here = Path(fsdp.__file__).parent
    unit_src = (here / "unit.py").read_text()
    names = {a.name for n in ast.walk(ast.parse(unit_src)) if isinstance(n, ast.ImportFrom)
             for a in n.names} | {n.id for n in ast.walk(ast.parse(unit_src)) if isinstance(n, ast.Name)}
    assert "hooks" not in names
    net = GPT("nano")
    fsdp.apply_fsdp(net, comm=Comm())
    root, block = net._fsdp_unit, net.blocks[0]._fsdp_unit
    x, y = batch(config("nano"), 0, 2, 0, 1)
    net(x, y).backward()                       # the root took the units in: one context
    assert root.context is block.context and root.context.root is root
    root_only = {"units", "root", "prefetch_depth", "stage3_limits", "_forward_order", "_recording"}
    assert not root_only & set(vars(block)) and not root_only & set(vars(root))
    assert set(root_only) <= set(vars(root.context))


def test_the_architecture_docs_lifecycle_table_points_at_the_functions_it_names():
    """docs/architecture.md's "FSDP lifecycle" table gives file:line for each step: each must
    be the ``def`` of a function the row names (update the table when the code moves)."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "architecture.md").read_text()
    table = next(b for b in doc[doc.index("### FSDP lifecycle"):].split("\n\n") if b.startswith("|"))
    rows = [r for r in table.splitlines()[2:] if r.startswith("|")]
    assert len(rows) >= 7
    for row in rows:
        for path, n in re.findall(r"`(minishard/[\w/]+\.py):(\d+)`", row):
            code = (root / path).read_text().splitlines()[int(n) - 1]
            name = re.match(r"\s*def (\w+)\(", code)
            assert name and name.group(1) in row, f"{path}:{n} is {code.strip()!r}, not in {row!r}"
