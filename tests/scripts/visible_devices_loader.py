"""Picks two of the machine's GPUs itself, before torch is imported, then trains a
DataParallel model over a DataLoader."""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = "2,3"

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

dataset = TensorDataset(torch.randn(512, 32), torch.randint(0, 1000, (512,)))
loader = DataLoader(dataset, batch_size=64, shuffle=True)
model = nn.DataParallel(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1000)))
model = model.cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = nn.CrossEntropyLoss()
for inputs, labels in loader:
    inputs, labels = inputs.cuda(), labels.cuda()
    optimizer.zero_grad()
    loss = criterion(model(inputs), labels)
    loss.backward()
    optimizer.step()
