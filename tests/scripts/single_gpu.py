"""One GPU, batches made on the device (a synthetic benchmark's loop)."""

import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(64, 384), nn.Tanh(), nn.Linear(384, 384), nn.Tanh(),
                      nn.Linear(384, 10)).to(device)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for _ in range(4):
    inputs = torch.randn(96, 64, device=device)
    targets = torch.randint(0, 10, (96,), device=device)
    optimizer.zero_grad()
    outputs = model(inputs)
    loss = criterion(outputs, targets)
    loss.backward()
    optimizer.step()
