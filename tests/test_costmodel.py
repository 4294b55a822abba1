"""The planner reuses the live ledger's formulas and reproduces published figures."""
import re
from dataclasses import replace

import pytest

from minishard.planner.costmodel import DEVICES, LINKS, Cluster, choose, plan, ring_time
from minishard.planner.deepspeed_estimator import deepspeed_estimate
from minishard.core.model import GPTConfig, config

H100 = Cluster(DEVICES["h100-80gb"], gpus_per_node=8)


def test_zero_paper_figure_1_from_the_planner():
    """ZeRO (Rajbhandari et al. 2020), Figure 1: Psi = 7.5 B, 64 GPUs, mixed-precision Adam:
    120 / 31.4 / 16.6 / 1.9 GB of model state per GPU."""
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=4096, n_layer=37, n_head=32, bias=False,
                    learned_pos=False)           # ~7.45 B parameters, close to the paper's 7.5 B
    cluster = Cluster(DEVICES["a100-80gb"], gpus_per_node=8, nodes=8)
    state = {s: sum(v for k, v in plan(cfg, cluster, s).memory.items()
                    if k not in ("activations", "unsharded", "comm_buffers"))
             for s in ("ddp", "zero1", "zero2", "zero3")}
    # per-parameter figures scaled to the paper's round 7.5 B
    got = [round(state[s] / 1e9 * 7.5e9 / _params(cfg), 1) for s in ("ddp", "zero1", "zero2", "zero3")]
    assert got == [120.0, 31.4, 16.6, 1.9]


def _params(cfg):
    from minishard.core.model import GPT
    return sum(p.numel() for p in GPT(cfg, device="meta").parameters())


def test_torchtitan_llama31_8b_memory_lies_between_full_and_no_recomputation():
    """torchtitan docs/performance.md, Table 1: Llama 3.1 8B, FSDP on 8 H100 (96 GB), local
    batch 2, sequence 8192, *selective* activation checkpointing: 82.4 GiB, 5,762 tokens/s/GPU
    (33-39% MFU). Selective recomputation sits between none and full, and so must the figure."""
    c = Cluster(DEVICES["h100-96gb"], gpus_per_node=8)
    full = plan("llama3-8b", c, "fsdp", micro_batch=2, seq_len=8192, recompute=True, mfu=0.39)
    none = plan("llama3-8b", c, "fsdp", micro_batch=2, seq_len=8192, recompute=False, mfu=0.39)
    assert full.total_memory / 2**30 < 82.4 < none.total_memory / 2**30
    # the FLOP accounting: at the published MFU, full recomputation (one extra forward) must be
    # a little slower than the published selective run, and no recomputation a little faster
    assert full.tokens_per_s_per_rank < 5762 * 1.05
    assert none.tokens_per_s_per_rank > 5762 * 0.95


def test_8b_under_ddp_does_not_fit_an_80_gb_gpu_but_zero3_does():
    p = {pl.strategy: pl for pl in choose("llama3-8b", H100, micro_batch=1, seq_len=4096,
                                          recompute=True)}
    assert not p["ddp"].fits and p["ddp"].total_memory > 16 * 8.03e9
    assert p["zero3"].fits
    assert "does not fit" in p["ddp"].verdict()


def test_hybrid_sharding_keeps_the_slow_network_out_of_the_sharding_collectives():
    slow = Cluster(DEVICES["h100-80gb"], gpus_per_node=8, nodes=4, inter=LINKS["ethernet-100g"])
    flat = plan("llama3-8b", slow, "fsdp", seq_len=4096, recompute=True)
    hybrid = plan("llama3-8b", slow, "fsdp", seq_len=4096, recompute=True, hybrid=True)
    assert hybrid.exposed_comm_s < flat.exposed_comm_s
    assert hybrid.total_memory > flat.total_memory        # sharded 8 ways, not 32


def test_ring_formula():
    link = LINKS["nvlink4"]
    assert ring_time("all_reduce", 1e9, 8, link) == pytest.approx(14 * 5e-6 + 1.75e9 / 450e9)
    assert ring_time("all_gather", 1e9, 1, link) == 0


@pytest.mark.parametrize("kw,match", [
    (dict(micro_batch=0), "micro_batch"), (dict(mfu=1.5), "mfu"),
])
def test_impossible_configurations_get_a_verdict(kw, match):
    with pytest.raises(ValueError, match=match):
        plan("nano", H100, **kw)


def test_more_ranks_than_parameters_is_refused():
    tiny = GPTConfig(vocab_size=4, seq_len=2, d_model=4, n_layer=1, n_head=1)
    with pytest.raises(ValueError, match="cannot each hold a shard"):
        plan(tiny, Cluster(DEVICES["h100-80gb"], gpus_per_node=8, nodes=64), "fsdp")


def test_a_device_smaller_than_one_gathered_unit_does_not_fit():
    """1,024 GPUs shard Llama-3-70B's state to about 1 GiB each; what a rank cannot shard is the
    unit it gathers to compute (a 70B block: 0.86 B parameters) — so a 6 GiB device holds the
    state and the activations, and fails on the unit alone; a 16 GiB device fits."""
    def on(gib: float):
        device = replace(DEVICES["h100-80gb"], memory=int(gib * 2**30))
        return plan("llama3-70b", Cluster(device, gpus_per_node=8, nodes=128), "fsdp",
                    seq_len=512, recompute=True)
    small, large = on(6), on(16)
    gathered = small.memory["unsharded"] + small.memory.get("comm_buffers", 0)
    assert small.total_memory - gathered < small.device_memory < small.total_memory
    assert not small.fits and large.fits and large.total_memory == small.total_memory


@pytest.mark.parametrize("N", [2, 4])
def test_planner_memory_matches_measured_runs_within_2_percent(pools, N):
    """The planner's memory for this machine's runs (fp32, the explicit-attention tiny GPT) is
    the live ledger's measured peak, for DDP and ZeRO-3."""
    from minishard.training.loop import TrainConfig, train
    cpu = Cluster(DEVICES["h100-80gb"], gpus_per_node=N)       # the device does not matter here
    runs = [("ddp", "ddp", 0, True), ("zero3", "fsdp_flat", 0, True), ("zero3", "fsdp_flat", 2, True)]
    for strategy, ours, prefetch, k in runs + ([("zero3", "fsdp_flat", 0, 2)] if N == 4 else []):
        measured = pools(N).run(train, TrainConfig(strategy=ours, model="tiny", micro_batch=4, steps=2, prefetch=prefetch,
                                                   reshard_after_forward=k))[0]["ledger"]["peak"]
        p = plan("tiny", cpu, strategy, micro_batch=4, precision="fp32", prefetch=prefetch,
                 flash_attention=False, reshard_after_forward=None if k is True else k)
        predicted = sum(v for k, v in p.memory.items() if k != "comm_buffers")
        assert abs(predicted - measured) <= 0.02 * measured, (strategy, prefetch, k, predicted, measured)


def test_planner_offload_traffic_is_what_the_engine_moves():
    """Per step, tiny GPT on 2 ranks: each block's fp32 shard fetched twice, the root's once,
    every gradient slice returned once: 23,215,104 + 13,737,984 bytes, as chapter 08 measures."""
    p = plan("tiny", Cluster(DEVICES["h100-80gb"], gpus_per_node=2), "fsdp", offload="host",
             precision="fp32", flash_attention=False)
    assert p.transfer_bytes == 23_215_104 + 13_737_984


@pytest.mark.parametrize("gpus", [2, 8])
def test_planner_offload_time_is_chapter_08s(gpus):
    """Chapter 08's model of offload's time, term by term: PCIe carries the inbound shards and
    the outbound gradient shards at once, so the step waits for the larger, 8Ψ/N-ish bytes
    in over β_h (not the sum); the CPU Adam step streams 28 bytes an element (reads weight,
    gradient and two moments, writes three back) through the host's memory, which all the
    node's GPUs share (so eight GPUs take eight times one's). The plan's step adds both, and
    the advice names both."""
    from minishard.planner.advice import Advice
    from minishard.planner.costmodel import CPU_ADAM_BYTES, HOST_MEMORY_BANDWIDTH, param_counts
    cfg = config("llama3-8b")
    cluster = Cluster(DEVICES["h100-80gb"], gpus_per_node=gpus)
    on, off = (plan(cfg, cluster, "fsdp", seq_len=8192, recompute=True, offload=o) for o in (None, "host"))
    psi = param_counts(cfg)[0]
    inbound, outbound = off.transfer_bytes - 4 * psi / gpus, 4 * psi / gpus
    assert inbound > outbound
    assert off.offload_pcie_s == pytest.approx(inbound / LINKS["pcie5-x16"].bandwidth, rel=1e-12)
    assert off.offload_cpu_s == pytest.approx(gpus * CPU_ADAM_BYTES * psi / gpus / HOST_MEMORY_BANDWIDTH, rel=1e-12)
    assert HOST_MEMORY_BANDWIDTH < 8 * 100e9                  # a two-socket host, shared: not 100 GB/s a GPU
    assert off.exposed_comm_s - on.exposed_comm_s == pytest.approx(off.offload_pcie_s + off.offload_cpu_s)
    assert on.offload_pcie_s == on.offload_cpu_s == 0
    advice = Advice(cfg, cluster, "ddp", seq_len=8192)          # DDP does not fit: offload is offered
    alt = advice.plan_for("ddp", offload="host")
    hint, = [h for h in advice.hints() if "offload" in h]
    assert (f"adds {alt.offload_pcie_s + alt.offload_cpu_s:.2f} s per step ({alt.offload_pcie_s:.2f} s of PCIe, "
            f"{alt.offload_cpu_s:.2f} s of CPU Adam") in hint, hint


@pytest.mark.parametrize("bad,words", [(True, "'host' or None, got True"), (1, "got 1"),
                                       (False, "got False"), (0, "got 0"),
                                       ("disk", "offload='disk': the planner models host memory")])
def test_the_planner_asks_which_tier_as_a_run_does(bad, words):
    """``offload`` names the tier everywhere (``TrainConfig.offload``, the planner): the old
    yes/no and the tier it does not model are refused by name."""
    with pytest.raises(ValueError, match=re.escape(words)):
        plan("tiny", Cluster(DEVICES["h100-80gb"], gpus_per_node=2), "fsdp", offload=bad)


# DeepSpeed docs, "Memory Requirements" (docs/code-docs/source/memory.rst, deepspeed.readthedocs.io
# /en/latest/memory.html): the estimator's cold output for a 2851M-parameter model (t5-3b) with
# a 32M-parameter largest layer on 1 node x 8 GPUs. DeepSpeed prints "GB" for 2**30 bytes.
DEEPSPEED_ZERO2 = [(127.45, 5.31, "offload_optimizer=cpu"), (127.45, 15.93, "offload_optimizer=none")]
DEEPSPEED_ZERO3 = [
    (71.69, 0.12, "offload_param=cpu , offload_optimizer=cpu , zero_init=1"),
    (127.45, 0.12, "offload_param=cpu , offload_optimizer=cpu , zero_init=0"),
    (63.72, 0.78, "offload_param=none, offload_optimizer=cpu , zero_init=1"),
    (127.45, 0.78, "offload_param=none, offload_optimizer=cpu , zero_init=0"),
    (1.43, 6.09, "offload_param=none, offload_optimizer=none, zero_init=1"),
    (127.45, 6.09, "offload_param=none, offload_optimizer=none, zero_init=0"),
]


@pytest.mark.parametrize("stage,table", [(2, DEEPSPEED_ZERO2), (3, DEEPSPEED_ZERO3)])
def test_deepspeed_memory_estimator_table_from_the_ledger(stage, table):
    rows = deepspeed_estimate(2_851_000_000, 32_000_000, stage, gpus_per_node=8)
    got = [(round(r.per_cpu / 2**30, 2), round(r.per_gpu / 2**30, 2), r.options) for r in rows]
    assert got == table


def test_deepspeed_zero3_worked_example_in_megabytes():
    """The same page's t5-large example: 737.67M parameters, a 32.90M largest layer, 4 GPUs:
    3291 / 125 / 477 MB (``>> 20``) without offload / with both offloads / optimizer only."""
    rows = {r.options: int(r.per_gpu) >> 20
            for r in deepspeed_estimate(737_670_000, 32_900_000, 3, gpus_per_node=4)}
    assert rows["offload_param=none, offload_optimizer=none, zero_init=1"] == 3291
    assert rows["offload_param=cpu , offload_optimizer=cpu , zero_init=1"] == 125
    assert rows["offload_param=none, offload_optimizer=cpu , zero_init=1"] == 477


def test_deepspeed_gpu_column_is_the_ledger_plus_named_terms():
    from minishard.planner.analytic import estimate
    n, layer = 1_000_003, 40_000           # 8 ranks do not divide n: shards are padded
    z3 = deepspeed_estimate(n, layer, 3, gpus_per_node=8)[-1]
    ledger = estimate(n_params=n, world_size=8, strategy="zero3", precision="bf16_mixed_fp32_grads")
    assert z3.per_gpu == ledger.state_bytes + 4 * layer
    assert set(z3.terms) - set(ledger.per_rank) == {"largest layer gathered (16-bit params + grads)"}
    z2 = deepspeed_estimate(n, layer, 2, gpus_per_node=8)[1]
    assert z2.terms["whole-model 16-bit grads"] == 2 * n and z2.terms["params"] == 2 * n


def test_deepspeed_largest_layer_of_a_model():
    from minishard.planner.deepspeed_estimator import largest_layer_params
    from minishard.core.model import GPT, config
    cfg = config("tiny")
    assert largest_layer_params(GPT(cfg, device="meta")) == cfg.vocab_size * cfg.d_model


@pytest.mark.parametrize("kw,msg", [({"stage": 1}, "stages 2 and 3"),
                                    ({"largest_layer": 10**9}, "largest_layer"),
                                    ({"gpus_per_node": 0}, "gpus_per_node")])
def test_deepspeed_estimate_bad_input(kw, msg):
    args = {"n_params": 10**6, "largest_layer": 10**4, "stage": 3} | kw
    with pytest.raises(ValueError, match=msg):
        deepspeed_estimate(**args)


def test_a_plan_above_90_percent_of_the_device_is_warned_about():
    """The margin the planner leaves for what it does not model (the CUDA context, NCCL's
    buffers, fragmentation): the same warning for the CLI, the widget and its suggestions."""
    from minishard.planner.costmodel import HEADROOM, warnings
    roomy = plan("llama3-8b", H100, "fsdp", seq_len=4096, recompute=True)
    assert roomy.fits and roomy.device_share < HEADROOM and warnings(roomy) == []
    device = replace(DEVICES["h100-80gb"], memory=roomy.total_memory / 0.95)
    tight = plan("llama3-8b", Cluster(device, gpus_per_node=8), "fsdp", seq_len=4096, recompute=True)
    assert tight.fits and tight.tight
    assert warnings(tight) == ["95% of the device, and the plan leaves out the CUDA context, NCCL's "
                               "buffers, allocator fragmentation and kernel temporaries: they can tip it over."]
    assert warnings(plan("llama3-8b", H100, "ddp", seq_len=4096)) == []   # does not fit: nothing to warn


def test_one_unit_for_the_whole_model_gathers_all_of_it_and_hides_nothing():
    from minishard.core.model import config
    n = _params(config("llama3-8b"))
    block = plan("llama3-8b", H100, "fsdp", seq_len=4096, recompute=True)
    whole = plan("llama3-8b", H100, "fsdp", seq_len=4096, recompute=True, wrap="model")
    assert whole.memory["unsharded"] == 2 * n > 5 * block.memory["unsharded"]   # root + 2 blocks
    assert whole.exposed_comm_s == whole.comm_s > 0                 # nothing overlaps compute
    assert whole.compute_s == block.compute_s
    assert "1 unit (the whole model), 2 collectives per step" in whole.notes
    assert plan("llama3-8b", H100, "ddp", seq_len=4096, wrap="model") == plan("llama3-8b", H100, "ddp", seq_len=4096)
    with pytest.raises(ValueError, match="wrap"):
        plan("nano", H100, wrap="layer")


def test_the_logits_the_loss_keeps():
    from minishard.planner.costmodel import logits_bytes
    from minishard.core.model import config
    assert logits_bytes(config("tiny"), 4, 128, 4) == 4 * 128 * 4096 * 4     # chapter 10's 8 MiB


def test_the_no_communication_reference_runs_on_every_rank_of_a_pool(pools):
    """bench.py and bench_planner.py time single-process training on every rank at once
    (``measure_compute``): inside a process group, ``train(None, ...)`` is a world of one."""
    from minishard.course.ch10 import measure_compute
    times = pools(2).run(measure_compute, steps=2, model="nano", micro_batch=2)
    assert [len(t) for t in times] == [2, 2] and all(s > 0 for t in times for s in t)


@pytest.mark.parametrize("intra", ["nvlink4", "pcie4-x16"])
def test_zero1_and_zero2_both_wait_for_the_parameter_all_gather_after_the_step(intra):
    """Both stages end the step with the same all-gather of the updated parameters, with backward
    over and no compute to hide it: the same exposed time, at least that gather's."""
    cluster = Cluster(DEVICES["h100-80gb"], gpus_per_node=8, intra=LINKS[intra])
    z1, z2 = (plan("llama3-8b", cluster, s, seq_len=4096) for s in ("zero1", "zero2"))
    gather = ring_time("all_gather", 2 * 8_030_261_248, 8, LINKS[intra])
    assert z1.exposed_comm_s == pytest.approx(z2.exposed_comm_s)
    assert z2.exposed_comm_s >= gather * 0.999


def test_reshard_after_forward_k_trades_memory_for_waiting_at_scale():
    """Llama-3-8B on 2 nodes x 8 H100s over InfiniBand HDR: k = 8 (a node) keeps 1/8 of every
    block gathered from forward to backward and moves backward's gathers onto NVLink — more
    memory than True, less waiting; bad values are refused."""
    c = Cluster(DEVICES["h100-80gb"], 8, nodes=2, inter=LINKS["ib-hdr-200"])
    flat, k8 = (plan("llama3-8b", c, "fsdp", seq_len=8192, recompute=True, reshard_after_forward=k)
                for k in (None, 8))
    assert k8.total_memory > flat.total_memory and k8.exposed_comm_s < flat.exposed_comm_s
    k16 = plan("llama3-8b", c, "fsdp", seq_len=8192, recompute=True, reshard_after_forward=16)
    assert (k16.comm_s, k16.total_memory) == (flat.comm_s, flat.total_memory)    # 16 ranks: True
    for bad, strategy in ((3, "fsdp"), (0, "fsdp"), (True, "fsdp"), (2, "ddp")):
        with pytest.raises(ValueError, match="reshard_after_forward"):
            plan("llama3-8b", c, strategy, reshard_after_forward=bad)


def test_reshard_after_forward_k_terms_to_the_formula():
    """The planner's two terms for k, exactly: every block not yet gathered again holds x·block/k
    (n_layer − prefetch blocks at the end of forward, one fewer inside backward), and backward's
    gathers run over k ranks on the node's link."""
    from minishard.planner.costmodel import _sizes, memory_per_gpu
    from minishard.core.model import config as model_config
    s = _sizes(model_config("llama3-8b"), "bf16_fsdp", 16)
    kept = s.x * s.block / 8
    for prefetch in (0, 1, 2):
        for acts, inside in ((10**13, False), (0, True)):
            args = (s, 3, "bf16_fsdp", "adamw", acts)
            kw = dict(prefetch=prefetch, offload=None, bucket_cap_mb=25.0)
            (base, n0), (k8, n8) = (memory_per_gpu(*args, **kw, post_forward=k) for k in (None, 8))
            assert ("peak inside backward" in n0) == ("peak inside backward" in n8) == inside
            held = s.n_layer - prefetch - (1 if inside else 0)
            assert k8["unsharded"] - base["unsharded"] == kept * held, (prefetch, inside)
    c = Cluster(DEVICES["h100-80gb"], 8, nodes=2, inter=LINKS["ib-hdr-200"])
    p = plan("llama3-8b", c, "fsdp", seq_len=8192, recompute=True, reshard_after_forward=8)
    units = [s.root] + [s.block] * s.n_layer
    slow, fast = LINKS["ib-hdr-200"], c.intra
    want = sum(ring_time("all_gather", s.x * u, 16, slow) + ring_time("all_gather", s.x * u, 8, fast)
               + ring_time("reduce_scatter", s.g * u, 16, slow) for u in units)
    assert p.comm_s == pytest.approx(want, rel=1e-12)


def test_choose_lists_every_plan_that_fits_before_any_that_does_not():
    plans = choose("llama3-8b", H100, micro_batch=1, seq_len=4096, recompute=True)
    fits = [p.fits for p in plans]
    assert True in fits and False in fits and fits == sorted(fits, reverse=True)
    ok = [p.step_s for p in plans if p.fits]
    assert ok == sorted(ok)                                  # the fastest that fits first


def test_zero2_comm_buffers_are_two_of_the_engines_full_buckets():
    """``bucket_cap_mb`` is MiB everywhere a run reads it (PyTorch DDP's rule, and minishard's
    bucket planner): the planner's ZeRO-2 reserve — two buckets of gradients in flight — must be
    two of the buckets the live engine actually fills, 2 x 25 MiB = 52,428,800 bytes, or the
    plan and the measured ledger disagree by 2.4 MB per GPU."""
    from minishard.strategies.buckets import plan_buckets
    import torch
    one_mib = [torch.nn.Parameter(torch.empty(2**20 // 4, device="meta")) for _ in range(80)]  # fp32
    filled = plan_buckets([one_mib], cap_mb=25.0)
    full = max(sum(p.numel() * p.element_size() for p in ps) for _, ps in filled)
    assert full == 25 * 1024 * 1024
    for cap in (25.0, 4.0):
        z2 = plan("llama3-8b", H100, "zero2", seq_len=4096, bucket_cap_mb=cap)
        assert z2.memory["comm_buffers"] == 2 * cap * 1024 * 1024
    assert plan("llama3-8b", H100, "zero2", seq_len=4096).memory["comm_buffers"] == 2 * full


def test_deepspeed_estimator_on_two_nodes_matches_deepspeeds_formulas():
    """DeepSpeed's ``estimate_zero3_model_states_mem_needs`` (runtime/zero/stage3.py) and the
    ZeRO-2 no-offload case of ``estimate_zero2_model_states_mem_needs`` (stage_1_and_2.py), worked
    by hand for 2 nodes x 8 GPUs. The host column is one *node*: without ``zero.Init`` each of its
    8 ranks builds the whole fp32 model, 4 x 8 bytes a parameter — not the 16 ranks of the
    world, which would tell a user to buy twice the host memory a node needs."""
    P, L = 1_600_000_000, 50_000_000           # divisible by the 16 ranks: no shard padding
    gpn, nodes, N, buf = 8, 2, 16, 1.5
    want3 = {   # (per CPU, per GPU), DeepSpeed's branches in its own order
        "offload_param=cpu , offload_optimizer=cpu , zero_init=1": (P * 18 / nodes * buf, 4 * L),
        "offload_param=cpu , offload_optimizer=cpu , zero_init=0": (P * max(4 * gpn, 18 / nodes) * buf, 4 * L),
        "offload_param=none, offload_optimizer=cpu , zero_init=1": (P * 16 / nodes * buf, 4 * L + 2 * P / N),
        "offload_param=none, offload_optimizer=cpu , zero_init=0": (P * max(4 * gpn, 16 / nodes) * buf,
                                                                    4 * L + 2 * P / N),
        "offload_param=none, offload_optimizer=none, zero_init=1": (L * 4 * gpn * buf, 4 * L + 18 * P / N),
        "offload_param=none, offload_optimizer=none, zero_init=0": (P * 4 * gpn * buf, 4 * L + 18 * P / N),
    }
    got3 = {r.options: (r.per_cpu, r.per_gpu)
            for r in deepspeed_estimate(P, L, 3, gpus_per_node=gpn, nodes=nodes)}
    assert list(got3) == list(want3)
    for options, (cpu, gpu) in want3.items():
        assert got3[options] == (pytest.approx(cpu, rel=1e-12), pytest.approx(gpu, rel=1e-12)), options
    assert got3["offload_param=none, offload_optimizer=none, zero_init=0"][0] == 4 * 8 * P * 1.5
    z2 = {r.options: r for r in deepspeed_estimate(P, L, 2, gpus_per_node=gpn, nodes=nodes)}
    none = z2["offload_optimizer=none"]
    assert (none.per_cpu, none.per_gpu) == pytest.approx((P * 4 * gpn * buf, 4 * P + 16 * P / N), rel=1e-12)


def test_frozen_weights_are_counted_in_the_working_precision():
    """A frozen weight (LoRA's base model) keeps only its working copy: bf16 under bf16 mixed
    precision — the fp32 master copy exists for the optimizer, which never sees it. Counted at
    fp32, the estimate would tell a user the frozen base costs twice what it does. Checked against
    the bytes of the model actually cast to bf16; under FSDP's policy the fp32 shards are the
    only copy, so there it is 4 bytes."""
    import torch
    from minishard.planner.analytic import estimate
    from minishard.core.model import GPT
    net = GPT("nano", device="meta")
    net.tok_emb.weight.requires_grad_(False)
    frozen = net.tok_emb.weight.numel()
    bf16 = net.to(torch.bfloat16)
    working = sum(p.numel() * p.element_size() for p in bf16.parameters())   # frozen + trainable
    est = estimate(net, precision="bf16_mixed", frozen=frozen)
    assert est.per_rank["params"] == working
    assert est.per_rank["master"] == 4 * (sum(p.numel() for p in net.parameters()) - frozen)
    fsdp = estimate(net, strategy="fsdp", precision="bf16_fsdp", frozen=frozen)
    plain = estimate(net, strategy="fsdp", precision="bf16_fsdp")
    assert fsdp.per_rank["master"] - plain.per_rank["master"] == frozen * torch.float32.itemsize


def test_flash_attention_log_sum_exp_is_fp32_in_any_compute_dtype():
    """A fused attention kernel keeps one log-sum-exp per query row for backward, and keeps it in
    fp32 whatever the compute dtype (PyTorch's own kernel, measured here). Halving the compute
    dtype halves every other tensor the formula counts, so the bytes it counts that do *not*
    change with the dtype are exactly the fixed-dtype ones: per layer the kernel's log-sum-exp,
    plus the int64 token ids and targets. Counted in bf16, a long-sequence bf16 plan would
    under-count what backward holds."""
    import torch
    import torch.nn.functional as F
    from minishard.planner.analytic import gpt_activation_bytes
    from minishard.core.model import config
    cfg = config("nano")                                  # LayerNorm: its saved tensors scale too
    B, T, H = 2, cfg.seq_len, cfg.n_head

    def kernel_saves(dtype) -> int:
        q, k, v = (torch.randn(B, H, T, cfg.d_model // H, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in saved}.values())

    fixed_kernel = 2 * kernel_saves(torch.bfloat16) - kernel_saves(torch.float32)
    assert fixed_kernel == B * H * T * torch.float32.itemsize          # the fp32 log-sum-exp
    f = {x: gpt_activation_bytes(cfg, B, T, dtype_bytes=x, flash_attention=True) for x in (2, 4)}
    ids_and_targets = 2 * B * T * torch.int64.itemsize
    assert 2 * f[2] - f[4] == cfg.n_layer * fixed_kernel + ids_and_targets
