"""Rank tasks of the checkpoint tests (importable by the rank processes). Each runs several
scenarios per launch: starting ranks costs seconds, a nano model's save or load milliseconds."""
import contextlib
import os
import signal
import time

import torch

from minishard import checkpoint
from minishard.core.comm import Comm
from minishard.core.model import GPT, batch, config
from minishard.training.loop import TrainConfig, build, train, train_step

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
    from minishard.strategies import fsdp
    from minishard.strategies import get
    from minishard.strategies.fsdp.recipe import FSDPBuilt
    cfg = config(MODEL)
    comm = Comm(rank.tracer)
    net = GPT(cfg, seed=0)
    fsdp.apply_fsdp(net, comm=comm, layout=layout, blocks=dict(replicate_params=("ln1", "ln2")),
                    root=dict(replicate_params=("ln_f",)))
    opt = fsdp.ShardedOptimizer(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    built = FSDPBuilt(get("fsdp"), net, opt, (comm,))
    for step in range(2):
        train_step(built, [batch(cfg, step, MICRO_BATCH, rank.rank, rank.world_size)])
    checkpoint.save(net, opt, path, comm=comm, step=2)
    return portable(checkpoint.local_state(net, opt, comm))


# ====================================================================== background saves

def _built(rank, strategy: str, steps: int = 2, seed: int = 0):
    """A nano model under ``strategy`` after ``steps`` AdamW steps, ready to train on."""
    comm = Comm(rank.tracer)
    cfg = config(MODEL)
    built = build(GPT(cfg, seed=seed), TrainConfig(strategy, model=MODEL), comm)
    for step in range(steps):
        train_step(built, [batch(cfg, step, MICRO_BATCH, rank.rank, rank.world_size)])
    return built, comm, cfg


@contextlib.contextmanager
def held_writes():
    """Background writes wait for ``gate`` to be set (the main thread's writes never do), and a
    collective issued off the main thread in the training's group (the default one) raises at
    once rather than pairing with the training's collectives. Yields the gate."""
    import threading

    import torch.distributed as dist
    gate = threading.Event()
    real = {"write": checkpoint.saving.write_safetensors, "all_gather_object": dist.all_gather_object,
            "all_reduce": dist.all_reduce}

    def in_background():
        return threading.current_thread() is not threading.main_thread()

    def write(*args, **kwargs):
        if in_background():
            gate.wait()
        return real["write"](*args, **kwargs)

    def guarded(name):
        def collective(*args, group=None, **kwargs):
            if in_background() and group in (None, dist.group.WORLD):
                raise AssertionError(f"a background save's {name} in the training's group")
            return real[name](*args, group=group, **kwargs)
        return collective

    checkpoint.saving.write_safetensors = write
    dist.all_gather_object, dist.all_reduce = guarded("all_gather_object"), guarded("all_reduce")
    try:
        yield gate
    finally:
        checkpoint.saving.write_safetensors = real["write"]
        dist.all_gather_object, dist.all_reduce = real["all_gather_object"], real["all_reduce"]


@torch.no_grad()
def _change_everything(model, opt, comm) -> None:
    """Every value a checkpoint holds changed in place, as training changes it."""
    for g in checkpoint.describe(model, opt, comm).regions:
        g.view.add_(1.0)


def background_runs(rank, root: str, runs: list) -> list[dict]:
    """For each ``(name, strategy)``: train 2 steps; save synchronously to ``root/name_sync``;
    save in the background to ``root/name_bg`` — its write held back until training has taken
    a step and every saved value was changed again — then wait. Whether the save returned
    before its file was written; whether a load of ``name_bg`` into other weights gives what was
    held at the save. The first run also starts a second save while one is
    in flight, and notes whether it waited."""
    import threading
    import time
    out = []
    for k, (name, strategy) in enumerate(runs):
        built, comm, cfg = _built(rank, strategy)
        model, opt = built.model, built.optimizer
        sync = checkpoint.save(model, opt, os.path.join(root, f"{name}_sync"), comm=comm, step=2)
        held = checkpoint.local_state(model, opt, comm)
        with held_writes() as gate:
            pending = checkpoint.save(model, opt, os.path.join(root, f"{name}_bg"), comm=comm, step=2,
                                      background=True)
            returned_first = not pending.done()
            train_step(built, [batch(cfg, 2, MICRO_BATCH, rank.rank, rank.world_size)])
            _change_everything(model, opt, comm)
            gate.set()
            info = pending.wait()
        r = {"name": name, "returned_first": returned_first, "host_copy_bytes": info["host_copy_bytes"], "bytes_written": info["bytes_written"],
             "sync_host_copy_bytes": sync["host_copy_bytes"], "step": info["step"]}
        if k == 0:
            with held_writes() as gate:
                first = checkpoint.save(model, opt, os.path.join(root, f"{name}_a"), comm=comm,
                                        step=3, background=True)
                released = []
                threading.Timer(0.3, lambda: (released.append(time.perf_counter()), gate.set())).start()
                second = checkpoint.save(model, opt, os.path.join(root, f"{name}_b"), comm=comm,
                                         step=3, background=True)
                r["second_waited"] = first.done() and bool(released) and time.perf_counter() >= released[0]
                gate.set()
                second.wait()
        fresh, comm2, _ = _built(rank, strategy, steps=0, seed=1)
        checkpoint.load(fresh.model, fresh.optimizer, os.path.join(root, f"{name}_bg"), comm=comm2)
        again = checkpoint.local_state(fresh.model, fresh.optimizer, comm2)
        r["load_equal"] = held.keys() == again.keys() and all(
            torch.equal(a, b) for n in held for (_, a), (_, b) in zip(held[n], again[n]))
        out.append(r)
    return out


def background_fails(rank, path: str, bad_rank: int) -> dict:
    """A good checkpoint at ``path`` (step 2); then a background save over it whose write fails on
    rank ``bad_rank`` alone: what each rank's wait raised. Then another background save, which
    must work (the save's group survives a failed save) — though rank 0 is slow to remove the
    failed save's directory: no rank may start writing the next one before it is gone."""
    built, comm, _ = _built(rank, "zero1")
    model, opt = built.model, built.optimizer
    checkpoint.save(model, opt, path, comm=comm, step=2)
    real = checkpoint.saving.write_safetensors

    def failing(*args, **kwargs):
        if rank.rank == bad_rank:
            raise checkpoint.CheckpointError(f"planted failure on rank {bad_rank}")
        return real(*args, **kwargs)

    real_rmtree = checkpoint.saving.shutil.rmtree

    def slow_rmtree(*args, **kwargs):
        time.sleep(0.5)
        return real_rmtree(*args, **kwargs)

    checkpoint.saving.write_safetensors = failing
    checkpoint.saving.shutil.rmtree = slow_rmtree
    try:
        pending = checkpoint.save(model, opt, path, comm=comm, step=3, background=True)
        try:
            pending.wait()
            raised = None
        except checkpoint.CheckpointError as e:
            raised = str(e)
    finally:
        checkpoint.saving.write_safetensors = real
        checkpoint.saving.shutil.rmtree = real_rmtree
    after_failure = checkpoint.read_metadata(path)["step"]
    again = checkpoint.save(model, opt, path, comm=comm, step=4, background=True).wait()
    return {"raised": raised, "after_failure": after_failure, "again": again["step"]}


def _slow_background_writes(seconds: float):
    """Every write in a background thread starts ``seconds`` late: a run that did not wait for
    its last save would end before the checkpoint is there."""
    import threading
    import time
    real = checkpoint.saving.write_safetensors

    def slow(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(seconds)
        return real(*args, **kwargs)
    return real, slow


def train_saving_in_background(rank, path: str, steps: int, every: int = 1) -> dict:
    """``train`` with a background save after every ``every``-th step and after the last, each
    write held up 0.2 s: when train returns, the last step's checkpoint must be on disk."""
    real, slow = _slow_background_writes(0.2)
    checkpoint.saving.write_safetensors = slow
    try:
        out = train(rank, TrainConfig(strategy="fsdp", model=MODEL, steps=steps, micro_batch=MICRO_BATCH,
                                      track_activations=False, save_to=path, save_every=every,
                                      save_background=True))
    finally:
        checkpoint.saving.write_safetensors = real
    return {"on_disk": checkpoint.read_metadata(path)["step"], "stalls": out["checkpoint"]["save"]["stalls"],
            "leftover": os.path.exists(os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.saving"))}


def background_save_then_die(rank, path: str, die_rank: int) -> None:
    """Train 2 steps saving in the background after each; resume and train on, saving the same
    way — and inside the first background write, rank ``die_rank`` writes half of its file and
    SIGKILLs itself while the others train on."""
    kw = dict(strategy="zero1", model=MODEL, micro_batch=MICRO_BATCH, track_activations=False,
              save_every=1, save_background=True)
    train(rank, TrainConfig(steps=2, save_to=path, **kw))
    real_write = checkpoint.saving.write_safetensors

    def dying_write(file, entries, tensors, *args):
        if rank.rank == die_rank:
            with open(file, "wb") as f:
                f.write(b"\0" * 1000)
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(file, entries, tensors, *args)

    checkpoint.saving.write_safetensors = dying_write
    train(rank, TrainConfig(steps=3, resume_from=path, save_to=path, **kw))
