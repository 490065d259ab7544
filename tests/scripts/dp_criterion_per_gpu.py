"""The criterion applied on each GPU, as segmentation repositories keep the loss off cuda:0
with PyTorch-Encoding's pair of DataParallel subclasses (written here from their
description): one whose gather leaves each replica's outputs on its GPU, one around the
criterion whose forward scatters the targets and applies a replica of the criterion on each
GPU in a thread of its own, to the replica's outputs spread and its targets, then averages
the losses on cuda:0."""

import threading

import torch
import torch.nn as nn
from torch.nn.parallel import DataParallel


class OutputsPerGpu(DataParallel):
    def gather(self, outputs, output_device):
        return outputs


class CriterionPerGpu(DataParallel):
    def forward(self, outputs, *targets, **kwargs):
        targets, kwargs = self.scatter(targets, kwargs, self.device_ids)
        replicas = self.replicate(self.module, self.device_ids[:len(outputs)])
        losses = [None] * len(outputs)

        def apply(i):
            with torch.cuda.device(outputs[i][0].device):
                losses[i] = replicas[i](*(tuple(outputs[i]) + tuple(targets[i])), **kwargs[i])

        threads = [threading.Thread(target=apply, args=(i,)) for i in range(len(outputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(loss.to(self.output_device) for loss in losses) / len(losses)


class SegNet(nn.Module):
    def __init__(self, classes=21):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())
        self.head = nn.Conv2d(64, classes, 1)

    def forward(self, x):
        return (self.head(self.body(x)),)


model = SegNet().cuda()
model = OutputsPerGpu(model)
criterion = CriterionPerGpu(nn.CrossEntropyLoss(ignore_index=255))
rows = 16
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for step in range(4):
    image = torch.randn(rows, 3, 96, 96).cuda()
    target = torch.randint(0, 21, (rows, 96, 96)).cuda()
    outputs = model(image)
    loss = criterion(outputs, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
