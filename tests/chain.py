"""A model small enough for an FSDP step in milliseconds: three blocks and a head."""
import torch


class Chain(torch.nn.Module):
    """Three blocks declared 0, 1, 2 that forward runs in ``order`` (to test what follows the
    order forward ran the units in, not the order they were declared), then a head."""

    def __init__(self, order: tuple[int, ...] = (0, 1, 2)):
        super().__init__()
        self.order = order
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.blocks[i](x))
        return self.head(x).sum()
