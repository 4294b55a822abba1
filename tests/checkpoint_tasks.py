"""Rank tasks of the checkpoint tests (importable by the rank processes). Each runs several
scenarios per launch: starting ranks costs seconds, a nano model's save or load milliseconds."""
import contextlib
import os
import signal

import torch

from minishard import checkpoint
from minishard.comm import Comm
from minishard.model import GPT, batch, config
from minishard.train import TrainConfig, build, train, train_step

MODEL = "nano"
MICRO_BATCH = 2


def one_process_model(seed: int = 0, **overrides):
    """A nano GPT and its AdamW in this process (no ranks), after one step: what the one-process
    checkpoint tests save, corrupt and load."""
    cfg = config(MODEL, **overrides)
    net = GPT(cfg, seed=seed)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y = batch(cfg, 0, MICRO_BATCH)
    net(x, y).backward()
    opt.step()
    opt.zero_grad()
    return net, opt


def _trained(rank, strategy: str, precision: str, steps: int = 2, seed: int = 0):
    """A nano model and its optimizer under ``strategy``, after ``steps`` AdamW steps."""
    comm = Comm(rank.tracer)
    cfg = config(MODEL)
    built = build(GPT(cfg, seed=seed), TrainConfig(strategy, model=MODEL, precision=precision), comm)
    for step in range(steps):
        train_step(built, [batch(cfg, step, MICRO_BATCH, rank.rank, rank.world_size)])
    return built.model, built.optimizer, comm


def portable(dump: dict) -> dict:
    """``{name: [(start, tensor)]}`` as bytes: hundreds of tensors through the pool's queue would
    each take a file descriptor (torch shares tensors between processes through them)."""
    return {n: [(s, str(v.dtype).removeprefix("torch."), v.contiguous().view(torch.uint8).numpy().tobytes())
                for s, v in parts] for n, parts in dump.items()}


def _steps(opt) -> set:
    inner = getattr(opt, "optimizer", opt)
    return {float(st["step"]) for st in inner.state.values() if "step" in st}


def save_runs(rank, root: str, runs: list) -> dict:
    """For each ``(name, strategy, precision)``: train 2 steps, save to ``root/name``, and return
    what this rank holds (to compare with what every later layout loads)."""
    out = {}
    for name, strategy, precision in runs:
        model, opt, comm = _trained(rank, strategy, precision)
        checkpoint.save(model, opt, os.path.join(root, name), comm=comm, step=2)
        out[name] = portable(checkpoint.local_state(model, opt, comm))
    return out


@contextlib.contextmanager
def recording_reads():
    """Record, at the file boundary, every element range ``checkpoint.load`` reads from a saved
    piece: ``(file, key, lo, hi, element size)``. What the plan *says* is read is computed from
    metadata; this is what the load actually asked safetensors for."""
    import safetensors
    real, seen = safetensors.safe_open, []

    class Slice:
        def __init__(self, sl, file, key):
            self.sl, self.file, self.key = sl, file, key

        def get_dtype(self):
            return self.sl.get_dtype()

        def __getitem__(self, idx):
            values = self.sl[idx]
            seen.append((self.file, self.key, idx.start, idx.stop, values.element_size()))
            return values

    class Handle:
        def __init__(self, path, **kw):
            self.ctx, self.file = real(path, **kw), os.path.basename(path)

        def __enter__(self):
            self.h = self.ctx.__enter__()
            return self

        def __exit__(self, *exc):
            return self.ctx.__exit__(*exc)

        def get_slice(self, key):
            return Slice(self.h.get_slice(key), self.file, key)

    safetensors.safe_open = Handle
    try:
        yield seen
    finally:
        safetensors.safe_open = real


def load_runs(rank, root: str, loads: list) -> list:
    """For each ``(name, strategy, precision)``: a model with *other* initial weights and no
    optimizer state is built under ``strategy`` and loads ``root/name``. Each rank compares what
    it then holds with the checkpoint's whole tensors (``read_full``, itself checked against the
    savers by the test) and returns the elements it covered, any mismatch, its optimizer step and
    the reads it made — small answers, so that many loads fit one launch."""
    out, files = [], {}
    for name, strategy, precision in loads:
        comm = Comm(rank.tracer)
        built = build(GPT(config(MODEL), seed=1), TrainConfig(strategy, model=MODEL, precision=precision), comm)
        model, opt = built.model, built.optimizer
        with recording_reads() as seen:
            info = checkpoint.load(model, opt, os.path.join(root, name), comm=comm)
        if name not in files:
            files[name] = {n: t.reshape(-1) for n, t in checkpoint.read_full(os.path.join(root, name)).items()}
        full = files[name]
        cover, wrong = {}, []
        for g in checkpoint.describe(model, opt, comm).regions:
            if not g.load:
                continue
            want = full[g.name][g.start:g.start + g.numel]
            if g.cast:                      # a bf16 working copy: the master, rounded
                want = want.to(g.view.dtype)
            else:
                cover.setdefault(g.name, []).append((g.start, g.numel))
            if not torch.equal(g.view, want):
                wrong.append((g.name, g.start, g.cast))
        out.append({"name": name, "strategy": strategy, "cover": cover, "wrong": wrong,
                    "casts": sum(g.cast for g in checkpoint.describe(model, opt, comm).regions),
                    "steps": _steps(opt), "lr": getattr(opt, "optimizer", opt).param_groups[0]["lr"],
                    "reads": info["reads"], "bytes_read": info["bytes_read"], "step": info["step"],
                    "file_reads": seen})
    return out


def save_then_die(rank, path: str, die_rank: int) -> None:
    """Save a good checkpoint; train on from it; then, inside the second save, rank ``die_rank``
    writes half of its file and SIGKILLs itself — a node lost in the middle of a checkpoint."""
    kw = dict(strategy="zero1", model=MODEL, micro_batch=MICRO_BATCH, track_activations=False)
    train(rank, TrainConfig(steps=2, save_to=path, **kw))

    real_write = checkpoint.saving.write_safetensors      # what save() calls to write a rank's file

    def dying_write(file, entries, tensors, *args):
        if rank.rank == die_rank:
            with open(file, "wb") as f:
                f.write(b"\0" * 1000)                 # a partial file...
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)    # ...and the process is gone
        return real_write(file, entries, tensors, *args)

    checkpoint.saving.write_safetensors = dying_write
    train(rank, TrainConfig(steps=1, resume_from=path, save_to=path, **kw))


def one_rank_fails(rank, path: str, bad_rank: int) -> dict:
    """Save on every rank, then make rank ``bad_rank`` alone fail once inside the save and once
    inside the load: what each rank raised, and whether its model changed."""
    model, opt, comm = _trained(rank, "zero1", "fp32")
    checkpoint.save(model, opt, path, comm=comm, step=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)                        # what a failed load must leave as it is
    changed = [p.detach().clone() for p in model.parameters()]
    out = {}
    for what, module, name in (("save", checkpoint.saving, "write_safetensors"),
                               ("load", checkpoint.loading, "read_verified")):
        real = getattr(module, name)

        def failing(*args, real=real, **kwargs):
            if rank.rank == bad_rank:
                raise checkpoint.CheckpointError(f"planted failure on rank {bad_rank}")
            return real(*args, **kwargs)

        setattr(module, name, failing)
        try:
            if what == "save":
                checkpoint.save(model, opt, path + "_again", comm=comm, step=3)
            else:
                checkpoint.load(model, opt, path, comm=comm)
            out[what] = None
        except checkpoint.CheckpointError as e:
            out[what] = str(e)
        finally:
            setattr(module, name, real)
    out["unchanged"] = all(torch.equal(p, c) for p, c in zip(model.parameters(), changed))
    out["again_exists"] = os.path.exists(path + "_again")
    return out


def refusals(rank) -> dict:
    """What ``describe`` says of PyTorch's own sharded states: ZeroRedundancyOptimizer's
    partition and fully_shard's DTensor parameters (None: it described them)."""
    out = {}
    for strategy in ("torch_zero1", "torch_fsdp"):
        comm = Comm(rank.tracer)
        built = build(GPT(config(MODEL), seed=0), TrainConfig(strategy, model=MODEL), comm)
        try:
            checkpoint.describe(built.model, built.optimizer, comm)
            out[strategy] = None
        except checkpoint.CheckpointError as e:
            out[strategy] = str(e)
    return out


def save_with_replicated_norms(rank, path: str, layout: str) -> dict:
    """FSDP with every norm kept whole on every rank (``replicate_params``), 2 AdamW steps, saved
    to ``path``; returns what this rank holds."""
    from minishard import fsdp
    from minishard.strategies import Built, get
    cfg = config(MODEL)
    comm = Comm(rank.tracer)
    net = GPT(cfg, seed=0)
    for i, b in enumerate(net.blocks):
        fsdp.fully_shard(b, comm=comm, layout=layout, name=f"blocks.{i}", replicate_params=("ln1", "ln2"))
    fsdp.fully_shard(net, comm=comm, layout=layout, name="root", replicate_params=("ln_f",))
    opt = fsdp.ShardedOptimizer(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    built = Built(get("fsdp"), net, opt, (comm,), units=fsdp.units(net))
    for step in range(2):
        train_step(built, [batch(cfg, step, MICRO_BATCH, rank.rank, rank.world_size)])
    checkpoint.save(net, opt, path, comm=comm, step=2)
    return portable(checkpoint.local_state(net, opt, comm))
