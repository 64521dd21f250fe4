"""A small PyTorch CNN trained by distbelief (docs/your-own-model.md): the module is
plain PyTorch, distbelief.torch.TorchModel hands it to the replicas, and the shards
(Adagrad, checkpoints) stay distbelief's. Fashion-MNIST, from examples/:

    mpiexec -n 3 python -m distbelief train torch_cnn.toml --model torch_cnn:model

Then load the trained weights back into the module:

    net = CNN(); TorchModel.load_into(net, "runs/torch_cnn")
"""

import torch
from torch import nn

from distbelief.torch import TorchModel


class CNN(nn.Module):
    """conv 5x5 (16) - max pool 2 - conv 5x5 (32) - max pool 2 - dense: on (N, H, W, C)
    images as distbelief stores them (H and W multiples of 4)."""

    def __init__(self, height: int = 28, width: int = 28, channels: int = 1,
                 classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2))
        self.classify = nn.Linear(32 * (height // 4) * (width // 4), classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 3, 1, 2)  # distbelief's (N, H, W, C) as torch's (N, C, H, W)
        return self.classify(self.features(x).flatten(1))


def model() -> TorchModel:
    """The factory `--model torch_cnn:model` calls."""
    return TorchModel(CNN(), nn.CrossEntropyLoss(), name="torch_cnn")
