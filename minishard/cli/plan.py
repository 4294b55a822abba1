"""``minishard ledger`` and ``minishard plan``: answers for real models, without training.

A model is a built-in name (``llama3-8b``, ``gpt2-small``, ...) or ``--config FILE``, a Hugging
Face ``config.json`` read from disk (``minishard.hf_config``); it is built on the meta device, so
its parameter count is exact and nothing is allocated or downloaded.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

GiB = 2**30
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
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the config's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_ledger_arguments(p: argparse.ArgumentParser) -> None:
    _model_arguments(p, "llama3-8b")
    p.add_argument("--world-size", type=int, default=1, help="ranks sharing the state")
    p.add_argument("--strategy", default="ddp", help="ddp, zero1, zero2, zero3 (fsdp)")
    p.add_argument("--precision", default="bf16_mixed",
                   help="bf16_mixed, fp32, bf16_fsdp, bf16_mixed_fp32_grads, fp16_mixed")
    p.add_argument("--optimizer", default="adamw", help="adamw, adamw_8bit, sgd, sgd_momentum")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from ..costmodel import DEVICES, LINKS
    _model_arguments(p, "llama3-8b")
    g = p.add_argument_group("the cluster")
    g.add_argument("--cluster", choices=sorted(CLUSTERS), help="a named cluster (the flags below override it)")
    g.add_argument("--device", choices=sorted(DEVICES), help="the accelerator (default h100-80gb)")
    g.add_argument("--device-memory", type=float, metavar="GIB", help="override the device's memory, in GiB")
    g.add_argument("--gpus-per-node", type=int, help="devices per node (default 8)")
    g.add_argument("--nodes", type=int, help="nodes (default 1)")
    g.add_argument("--intra", choices=sorted(LINKS), help="the link inside a node (default nvlink4)")
    g.add_argument("--inter", choices=sorted(LINKS), help="the link between nodes (default ib-ndr-400)")
    g = p.add_argument_group("the job")
    g.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per forward")
    g.add_argument("--precision", default=None, help="default: each strategy's usual (docs/costmodel.md)")
    g.add_argument("--prefetch", type=int, default=1, help="FSDP units gathered ahead")
    g.add_argument("--wrap", choices=("block", "model"), default="block",
                   help="FSDP units: one per transformer block, or one for the whole model")
    g.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True,
                   help="activation recomputation")
    g.add_argument("--hybrid", action="store_true", help="ZeRO-3 sharded inside a node, replicated across")
    g.add_argument("--offload", action="store_true", help="the sharded state in host memory")
    g.add_argument("--mfu", type=float, default=0.4, help="achieved fraction of peak FLOP/s")


def model_config(args):
    from ..hf_config import config_from_hf
    from ..model import config
    if args.config:
        return config_from_hf(args.config, seq_len=args.seq_len)
    cfg = config(args.model)
    return cfg if args.seq_len is None else config(args.model, seq_len=args.seq_len)


def ledger(args) -> int:
    from ..ledger import estimate
    from ..model import GPT
    name = args.config or args.model
    est = estimate(GPT(model_config(args), device="meta"), world_size=args.world_size,
                   strategy=args.strategy, precision=args.precision, optimizer=args.optimizer)
    if args.json:
        print(json.dumps({"model": name, "n_params": est.n_params, "world_size": args.world_size,
                          "strategy": args.strategy, "precision": args.precision,
                          "optimizer": args.optimizer, "bytes_per_param": est.bytes_per_param,
                          "per_rank": est.per_rank}, indent=1))
        return 0
    print(f"{name}: {est.n_params:,} parameters, {args.strategy} on {args.world_size} ranks, "
          f"{args.precision}, {args.optimizer}: {est.bytes_per_param:.2f} bytes/param per rank")
    print(est.table(unit=1e9, unit_name="GB"))
    return 0


def cluster_of(args):
    from ..costmodel import DEVICES, LINKS, Cluster
    chosen = dict(CLUSTERS.get(args.cluster, CLUSTERS["h100-node"]))
    for key in ("device", "gpus_per_node", "nodes", "intra", "inter"):
        if getattr(args, key) is not None:
            chosen[key] = getattr(args, key)
    device = DEVICES[chosen["device"]]
    if args.device_memory is not None:
        if not args.device_memory > 0:
            raise ValueError(f"--device-memory must be a positive number of GiB, got {args.device_memory}")
        device = type(device)(device.name, int(args.device_memory * GiB), device.flops)
    if chosen["gpus_per_node"] < 1 or chosen["nodes"] < 1:
        raise ValueError(f"--gpus-per-node and --nodes must be >= 1 (got {chosen['gpus_per_node']}, "
                         f"{chosen['nodes']})")
    return Cluster(device, chosen["gpus_per_node"], chosen["nodes"], LINKS[chosen["intra"]],
                   LINKS[chosen["inter"]])


def plan(args) -> int:
    from .. import strategies
    from ..advice import Advice
    from ..model import GPT
    cfg, cluster = model_config(args), cluster_of(args)
    n_params = GPT(cfg, device="meta").num_params()
    job = dict(micro_batch=args.micro_batch, seq_len=args.seq_len, precision=args.precision,
               prefetch=args.prefetch, recompute=args.recompute, hybrid=args.hybrid,
               offload=args.offload, mfu=args.mfu, wrap=args.wrap)
    advice = {name: Advice(cfg, cluster, name, **job) for name in strategies.PLANNED}
    plans = {name: a.plan_for(name) for name, a in advice.items()}
    hints = {name: a.hints() for name, a in advice.items()}      # the widget's sentences
    if args.json:
        print(json.dumps({"model": args.config or args.model, "n_params": n_params,
                          "cluster": {"device": cluster.device.name, "gpus_per_node": cluster.gpus_per_node,
                                      "nodes": cluster.nodes, "intra": cluster.intra.name,
                                      "inter": cluster.inter.name},
                          "plans": {n: {**_plan_dict(p), "warnings": costmodel_warnings(p),
                                        "advice": hints[n]} for n, p in plans.items()}},
                         indent=1))
        return 0
    print(f"{args.config or args.model}: {n_params:,} parameters on {cluster.nodes} x "
          f"{cluster.gpus_per_node} {cluster.device.name} ({cluster.intra.name} inside a node, "
          f"{cluster.inter.name} between nodes)")
    cats = list(dict.fromkeys(c for p in plans.values() for c in p.memory))
    print(f"{'strategy':<8}" + "".join(f"{c:>12}" for c in cats) +
          f"{'GiB/GPU':>9}{'fits':>6}{'s/step':>8}{'tok/s/GPU':>11}{'waiting':>9}")
    for name, p in plans.items():
        print(f"{name:<8}" + "".join(f"{p.memory.get(c, 0) / GiB:>12.2f}" for c in cats) +
              f"{p.total_memory / GiB:>9.1f}{'yes' if p.fits else 'no':>6}{p.step_s:>8.2f}"
              f"{p.tokens_per_s_per_rank:>11,.0f}{p.exposed_comm_s / p.step_s:>9.0%}")
    print("what would you change? (the planner widget's advice, chapter 10)")
    for name in plans:
        for h in hints[name]:
            print(f" - {name}: {h}")
    return 0


def costmodel_warnings(p) -> list[str]:
    from ..costmodel import warnings
    return warnings(p)


def _plan_dict(p) -> dict:
    d = asdict(p)
    d.update(total_memory=p.total_memory, fits=p.fits, step_s=p.step_s)
    return d
