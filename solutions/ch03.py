"""Reference solution, chapter 03 (``minishard.course.exercises.ch03``)."""
import torch


def zero1_step(comm, flat_param, flat_grad, shard, optimizer):
    N, r = comm.world_size, comm.rank
    chunk = flat_param.numel() // N
    mine = torch.empty(chunk, dtype=flat_grad.dtype)
    comm.reduce_scatter(mine, flat_grad)          # the sum of my chunk over all ranks
    shard.grad = (mine / N).to(shard.dtype)       # the gradient of the mean loss
    optimizer.step()
    shard.grad = None
    comm.all_gather(flat_param, shard.detach().to(flat_param.dtype).clone())
