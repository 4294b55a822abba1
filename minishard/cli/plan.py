"""``minishard ledger`` and ``minishard plan``: answers for real models, without training.

A model is a built-in name (``llama3-8b``, ``gpt2-small``, ...) or ``--config FILE``, a Hugging
Face ``config.json`` read from disk (``minishard.core.hf_config``); it is built on the meta device, so
its parameter count is exact and nothing is allocated or downloaded.

``plan`` models sequences of ``TRAINING_SEQ_LEN`` tokens unless ``--seq-len`` says otherwise: a
config's ``max_position_embeddings`` is the longest sequence the model can read (Qwen2's is
131,072), not the length it is trained at, and planning at it makes the activations, not the
strategy, decide every answer. Memory is in binary units (GiB, as the chapters use), with the
decimal GB in parentheses where papers quote decimal figures (the ledger's).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict

GiB = 2**30
# plan's default tokens per sequence: Llama 2's context, a usual pretraining length (longer
# contexts are usually added in a later, shorter stage of training)
TRAINING_SEQ_LEN = 4096
# named clusters for --cluster (each a shortcut for the four flags below it)
CLUSTERS = {
    "h100-node": dict(device="h100-80gb", gpus_per_node=8, nodes=1, intra="nvlink4", inter="ib-ndr-400"),
    "h100-2nodes-ib": dict(device="h100-80gb", gpus_per_node=8, nodes=2, intra="nvlink4", inter="ib-ndr-400"),
    "h100-2nodes-ethernet": dict(device="h100-80gb", gpus_per_node=8, nodes=2, intra="nvlink4",
                                 inter="ethernet-100g"),
    "a100-node": dict(device="a100-80gb", gpus_per_node=8, nodes=1, intra="nvlink3", inter="ib-hdr-200"),
}


def _model_arguments(p: argparse.ArgumentParser, default: str) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", default=default, help=f"a built-in config name (default {default})")
    g.add_argument("--config", metavar="FILE", help="a Hugging Face config.json (Llama, Mistral, Qwen2, GPT-2), read locally")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_ledger_arguments(p: argparse.ArgumentParser) -> None:
    _model_arguments(p, "llama3-8b")
    p.add_argument("--world-size", type=int, default=1, help="ranks sharing the state")
    p.add_argument("--strategy", default="ddp", help="ddp, zero1, zero2, zero3 (fsdp)")
    p.add_argument("--precision", default="bf16_mixed",
                   help="bf16_mixed, fp32, bf16_fsdp, bf16_mixed_fp32_grads, fp16_mixed")
    p.add_argument("--optimizer", default="adamw", help="adamw, adamw_8bit, sgd, sgd_momentum")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from minishard.planner.costmodel import DEVICES, LINKS
    _model_arguments(p, "llama3-8b")
    g = p.add_argument_group("the cluster")
    g.add_argument("--cluster", choices=sorted(CLUSTERS), help="a named cluster (the flags below override it)")
    g.add_argument("--device", choices=sorted(DEVICES), help="the accelerator (default h100-80gb)")
    g.add_argument("--device-memory", type=float, metavar="GIB", help="override the device's memory, in GiB")
    g.add_argument("--gpus-per-node", type=int, help="devices per node (default 8)")
    g.add_argument("--nodes", type=int, help="nodes (default 1)")
    g.add_argument("--intra", choices=sorted(LINKS), help="the link inside a node (default nvlink4)")
    g.add_argument("--inter", choices=sorted(LINKS), help="the link between nodes (default ib-ndr-400; "
                                                          "unused on one node)")
    g = p.add_argument_group("the job")
    g.add_argument("--seq-len", metavar="N|config",
                   help=f"tokens per sequence (default {TRAINING_SEQ_LEN:,}, a usual training length, or "
                        f"the config's maximum where that is shorter); 'config': the config's maximum "
                        f"(max_position_embeddings)")
    g.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per forward")
    g.add_argument("--precision", default=None, help="default: each strategy's usual (docs/costmodel.md)")
    g.add_argument("--prefetch", type=int, default=1, help="FSDP units gathered ahead")
    g.add_argument("--wrap", choices=("block", "model"), default="block",
                   help="FSDP units: one per transformer block, or one for the whole model")
    g.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True,
                   help="activation recomputation")
    g.add_argument("--hybrid", action="store_true", help="ZeRO-3 sharded inside a node, replicated across")
    g.add_argument("--offload", choices=("host", "disk"), default=None,
                   help="the tier the sharded state lives in, as demo's --offload names it: host "
                        "(over PCIe; disk is not modelled and is refused)")
    g.add_argument("--mfu", type=float, default=0.4, help="achieved fraction of peak FLOP/s")


def model_config(args):
    """The model as its config states it: positions up to the config's maximum, so that a
    learned position table (GPT-2's) has its real size and the parameter count is exact."""
    from minishard.core.hf_config import config_from_hf
    from minishard.core.model import config
    return config_from_hf(args.config) if args.config else config(args.model)


def _positions(args, cfg) -> tuple[int, str]:
    """The longest sequence the config allows, and where that figure comes from."""
    if not args.config:
        return cfg.seq_len, f"{args.model}'s seq_len"
    from minishard.core.hf_config import read_hf_config
    if cfg.learned_pos:
        return cfg.seq_len, "the config's n_positions"
    if read_hf_config(args.config).get("max_position_embeddings"):
        return cfg.seq_len, "the config's max_position_embeddings"
    return cfg.seq_len, "the length assumed when a config has no max_position_embeddings"


def sequence_length(args, cfg) -> tuple[int, str]:
    """The tokens per sequence ``plan`` models, and how they were chosen (printed with the plan)."""
    limit, source = _positions(args, cfg)
    asked = args.seq_len
    if asked is None:
        if limit < TRAINING_SEQ_LEN:
            return limit, f"{source}, shorter than the default {TRAINING_SEQ_LEN:,}"
        return TRAINING_SEQ_LEN, f"the default training length; --seq-len config plans at {source}, {limit:,}"
    if asked.strip().lower() == "config":
        return limit, f"--seq-len config: {source}"
    try:
        n = int(asked.replace(",", "").replace("_", ""))
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--seq-len takes a positive number of tokens or 'config', got {asked!r}")
    if cfg.learned_pos and n > limit:
        raise ValueError(f"--seq-len {n:,} is longer than the model's {limit:,} learned positions "
                         f"({source}): pass at most {limit:,}")
    if n > limit:
        return n, f"--seq-len, longer than {source}, {limit:,}"
    return n, "--seq-len"


def check_common(args) -> None:
    """The flags ledger and plan share, refused in their own words before anything is built."""
    from minishard.planner.analytic import PRECISIONS
    from minishard.core.model import CONFIGS
    if getattr(args, "world_size", 1) < 1:
        raise ValueError(f"--world-size {args.world_size}: must be an integer >= 1")
    if args.precision is not None and args.precision not in PRECISIONS:      # plan: None = the model's own
        raise ValueError(f"--precision {args.precision}: unknown; use one of {', '.join(sorted(PRECISIONS))}")
    if not args.config and args.model not in CONFIGS:
        raise ValueError(f"--model {args.model}: no such built-in model; use one of "
                         f"{', '.join(sorted(CONFIGS))}, or --config a Hugging Face config.json")
    if getattr(args, "prefetch", 0) < 0:
        raise ValueError(f"--prefetch {args.prefetch}: must be an integer >= 0")


def ledger(args) -> int:
    from minishard.planner.analytic import estimate
    from minishard.core.model import GPT
    check_common(args)
    name = args.config or args.model
    est = estimate(GPT(model_config(args), device="meta"), world_size=args.world_size,
                   strategy=args.strategy, precision=args.precision, optimizer=args.optimizer)
    if args.json:
        print(json.dumps({"model": name, "n_params": est.n_params, "world_size": args.world_size,
                          "strategy": args.strategy, "precision": args.precision,
                          "optimizer": args.optimizer, "bytes_per_param": est.bytes_per_param,
                          "per_rank": est.per_rank}, indent=1))
        return 0
    print(f"{name}: {est.n_params:,} parameters, {args.strategy} on {args.world_size} "
          f"rank{'s' if args.world_size != 1 else ''}, "
          f"{args.precision}, {args.optimizer}: {est.bytes_per_param:.2f} bytes/param per rank")
    print(ledger_table(est))
    return 0


def ledger_table(est) -> str:
    """Bytes per rank in GiB, the decimal GB beside them: papers (ZeRO's 120 / 31.4 / 16.6 /
    1.9 GB) and DeepSpeed's estimator quote decimal figures."""
    rows = [("category", "per rank", "(decimal)", "sharded")]
    for k, v in est.per_rank.items():
        rows.append((k, f"{v / GiB:.3f} GiB", f"({v / 1e9:.3f} GB)", "yes" if est.sharded.get(k) else "no"))
    rows.append(("total", f"{est.total / GiB:.3f} GiB", f"({est.total / 1e9:.3f} GB)", ""))
    return _columns(rows, left=(0, 3))


def _columns(rows: list[tuple[str, ...]], left: tuple[int, ...] = (0,)) -> str:
    """Rows as a table: the ``left`` columns left-aligned, the others right-aligned, every column
    two spaces from the next, however long its heading."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     .rstrip() for r in rows)


def cluster_of(args):
    from minishard.planner.costmodel import DEVICES, LINKS, Cluster
    chosen = dict(CLUSTERS.get(args.cluster, CLUSTERS["h100-node"]))
    for key in ("device", "gpus_per_node", "nodes", "intra", "inter"):
        if getattr(args, key) is not None:
            chosen[key] = getattr(args, key)
    device = DEVICES[chosen["device"]]
    if args.device_memory is not None:
        if not (args.device_memory > 0 and math.isfinite(args.device_memory)):
            raise ValueError(f"--device-memory must be a positive, finite number of GiB, got "
                             f"{args.device_memory}")
        device = type(device)(device.name, int(args.device_memory * GiB), device.flops)
    if chosen["gpus_per_node"] < 1 or chosen["nodes"] < 1:
        raise ValueError(f"--gpus-per-node and --nodes must be >= 1 (got {chosen['gpus_per_node']}, "
                         f"{chosen['nodes']})")
    return Cluster(device, chosen["gpus_per_node"], chosen["nodes"], LINKS[chosen["intra"]],
                   LINKS[chosen["inter"]])


def network(cluster) -> str:
    """The links the plan's collectives run on: between nodes only when there is more than one."""
    if cluster.nodes == 1:
        return f"{cluster.intra.name} inside the node; one node, so no link between nodes"
    return f"{cluster.intra.name} inside a node, {cluster.inter.name} between nodes"


def plan(args) -> int:
    from minishard import strategies
    from minishard.planner.advice import Advice
    from minishard.core.model import GPT
    check_common(args)
    cfg, cluster = model_config(args), cluster_of(args)
    seq_len, chosen_by = sequence_length(args, cfg)
    if args.micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1 sequence, got {args.micro_batch}")
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu is a fraction of peak FLOP/s in (0, 1], got {args.mfu}")
    if args.offload == "disk":
        raise ValueError("--offload disk: the planner models host memory over PCIe only "
                         "(memory-mapped files on NVMe are not modelled); plan with --offload host")
    n_params = GPT(cfg, device="meta").num_params()
    job = dict(micro_batch=args.micro_batch, seq_len=seq_len, precision=args.precision,
               prefetch=args.prefetch, recompute=args.recompute, hybrid=args.hybrid,
               offload=args.offload, mfu=args.mfu, wrap=args.wrap)
    advice = {name: Advice(cfg, cluster, name, **job) for name in strategies.PLANNED}
    plans = {name: a.plan_for(name) for name, a in advice.items()}
    hints = {name: a.hints() for name, a in advice.items()}      # the widget's sentences
    if args.json:
        print(json.dumps({"model": args.config or args.model, "n_params": n_params,
                          "seq_len": seq_len, "seq_len_from": chosen_by, "micro_batch": args.micro_batch,
                          "cluster": {"device": cluster.device.name, "device_memory": cluster.device.memory,
                                      "gpus_per_node": cluster.gpus_per_node, "nodes": cluster.nodes,
                                      "intra": cluster.intra.name,
                                      "inter": cluster.inter.name if cluster.nodes > 1 else None},
                          "plans": {n: {**_plan_dict(p), "warnings": costmodel_warnings(p),
                                        "advice": hints[n]} for n, p in plans.items()}},
                         indent=1))
        return 0
    print(f"{args.config or args.model}: {n_params:,} parameters on {cluster.nodes} "
          f"node{'s' if cluster.nodes > 1 else ''} x {cluster.gpus_per_node} {cluster.device.name} "
          f"({cluster.device.memory / GiB:.1f} GiB each; {network(cluster)})")
    print(f"sequence length {seq_len:,} tokens ({chosen_by}), micro-batch {args.micro_batch}; "
          f"memory per GPU in GiB, time at {args.mfu:.0%} MFU")
    cats = list(dict.fromkeys(c for p in plans.values() for c in p.memory))
    rows = [("strategy", *cats, "GiB/GPU", "fits", "s/step", "tok/s/GPU", "waiting")]
    for name, p in plans.items():
        rows.append((name, *(f"{p.memory.get(c, 0) / GiB:.2f}" for c in cats), f"{p.total_memory / GiB:.1f}",
                     "yes" if p.fits else "no", f"{p.step_s:.2f}", f"{p.tokens_per_s_per_rank:,.0f}",
                     f"{p.exposed_comm_s / p.step_s:.0%}"))
    print(_columns(rows))
    print("what would you change? (the planner widget's advice, chapter 10)")
    # a sentence that holds for several strategies is printed once, naming them
    said: dict[str, list[str]] = {}
    for name in plans:
        for h in hints[name]:
            said.setdefault(h, []).append(name)
    for h, names in said.items():
        print(f" - {'every strategy' if len(names) == len(plans) else ', '.join(names)}: {h}")
    return 0


def costmodel_warnings(p) -> list[str]:
    from minishard.planner.costmodel import warnings
    return warnings(p)


def _plan_dict(p) -> dict:
    d = asdict(p)
    d.update(total_memory=p.total_memory, fits=p.fits, step_s=p.step_s)
    return d
