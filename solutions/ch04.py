"""Reference solution, chapter 04 (``minishard.course.exercises.ch04``)."""
import torch


def make_bucket_hook(comm, params, offsets, chunk, out):
    N = comm.world_size
    where = {id(p): (off, p.numel()) for p, off in zip(params, offsets)}
    state = {"buffer": None, "arrived": 0}

    def hook(p):
        if state["buffer"] is None:                    # the bucket's first gradient
            state["buffer"] = torch.zeros(N * chunk, dtype=p.grad.dtype)
        off, n = where[id(p)]
        state["buffer"][off:off + n].copy_(p.grad.reshape(-1))
        p.grad = None                                   # no full gradient stays
        state["arrived"] += 1
        if state["arrived"] == len(params):             # the bucket is complete: reduce it now
            mine = torch.empty(chunk, dtype=state["buffer"].dtype)
            comm.reduce_scatter(mine, state["buffer"])
            out.add_(mine / N)
            state["buffer"], state["arrived"] = None, 0

    return hook
