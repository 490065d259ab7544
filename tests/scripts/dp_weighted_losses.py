"""DataParallel with a class-weighted loss on an expression of the gathered outputs: a
cross-entropy whose weights live on cuda:0, on the outputs scaled by a temperature."""

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda:0")
classes = 500
model = nn.DataParallel(nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, classes)))
model.to(device)

weights = torch.linspace(0.5, 2.0, classes, device=device)  # rarer classes weigh more
criterion = nn.CrossEntropyLoss(weight=weights, label_smoothing=0.1)
temperature = 2.0
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

data = TensorDataset(torch.randn(2048, 64), torch.randint(0, classes, (2048,)))
for inputs, labels in DataLoader(data, batch_size=256, shuffle=True):
    inputs, labels = inputs.to(device), labels.to(device)
    outputs = model(inputs)
    loss = criterion(outputs / temperature, labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
