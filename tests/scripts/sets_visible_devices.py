"""A script that picks its GPUs itself, before importing torch."""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = "1,2"

import torch
import torch.nn as nn

assert torch.cuda.device_count() == 2, torch.cuda.device_count()
model = nn.DataParallel(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1000)))
model = model.cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = nn.CrossEntropyLoss()
for _ in range(4):
    inputs = torch.randn(64, 32).cuda()
    labels = torch.randint(0, 1000, (64,)).cuda()
    optimizer.zero_grad()
    loss = criterion(model(inputs), labels)
    loss.backward()
    optimizer.step()
