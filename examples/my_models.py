"""A user model and dataset for spotpipe, loaded by `examples/user_factory.yaml`.

Any `package.module:function` works; this module is found because it sits beside the config.
"""

import torch
from torch import nn


def mlp(width: int = 64, depth: int = 6):
    """An MLP regressor as a layer list: every layer takes one tensor and returns one."""
    layers = [nn.Linear(16, width), nn.GELU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers), nn.MSELoss()


class Waves(torch.utils.data.Dataset):
    """y = sin(sum(x) / 4): smooth enough that the loss visibly falls in a few hundred steps."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.sin(self.x.sum(dim=1, keepdim=True) / 4)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def waves(n: int = 4096):
    return Waves(n)
