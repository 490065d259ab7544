"""Workloads whose models name their devices themselves (issue 11 part 3), for dpprof compare."""

from __future__ import annotations

import os

import torch
from torch import nn

import dpprof


class TwoGpuModel(nn.Module):
    """The model-parallel tutorial's ToyModel: net1 on cuda:0, net2 on cuda:1."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(1000, 2000).to("cuda:0")
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(2000, 500).to(torch.device("cuda", 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x.to("cuda:0")))
        return self.net2(x.to("cuda:1"))


def mse_on_outputs_device(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The tutorial's loss: the labels go where the outputs are."""
    return nn.functional.mse_loss(outputs, targets.to(outputs.device))


def model_parallel() -> dpprof.Workload:
    return dpprof.Workload(
        name="two-gpu-toy",
        model=TwoGpuModel,
        batch=lambda rows, device: (torch.randn(rows, 1000, device=device),
                                    torch.randn(rows, 500, device=device)),
        loss=mse_on_outputs_device,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.001),
    )


class CudaInForward(nn.Module):
    """Moves its input with .cuda() and logs a value with .item() in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 32).cuda()
        self.seen = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x.cuda())
        self.seen += y.detach().abs().mean().item()
        if bool(y.isnan().any()):
            raise FloatingPointError("nan")
        return y


def item_in_forward() -> dpprof.Workload:
    return dpprof.Workload(
        name="item-in-forward",
        model=CudaInForward,
        batch=lambda rows, device: (torch.randn(rows, 64, device=device),
                                    torch.randint(0, 32, (rows,), device=device)),
        loss=nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )


class MaskedMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y[y > 0].sum() + y.sum()


def masked() -> dpprof.Workload:
    return dpprof.Workload(
        name="masked",
        model=MaskedMean,
        batch=lambda rows, device: (torch.randn(rows, 16, device=device),
                                    torch.zeros(rows, device=device)),
        loss=lambda out, _: out,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )


def keras_mlp() -> dpprof.Workload:
    """A Keras 3 model on the torch backend."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras

    def model() -> nn.Module:
        return keras.Sequential([
            keras.Input(shape=(64,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ])

    return dpprof.Workload(
        name="keras-mlp",
        model=model,
        batch=lambda rows, device: (torch.randn(rows, 64, device=device),
                                    torch.randint(0, 10, (rows,), device=device)),
        loss=nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
    )


def model_parallel_plain_loss() -> dpprof.Workload:
    """The tutorial's ToyModel with a plain loss: the loop moves the labels to the outputs'
    GPU (the tutorial's ``labels.to(outputs.device)``)."""
    return dpprof.Workload(
        name="two-gpu-toy-mse",
        model=TwoGpuModel,
        batch=lambda rows, device: (torch.randn(rows, 1000, device=device),
                                    torch.randn(rows, 500, device=device)),
        loss=nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.001),
    )
