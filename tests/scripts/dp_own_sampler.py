"""A DataParallel classifier whose DataLoader draws its rows with a sampler of its own (a
WeightedRandomSampler over classes of unequal size, as imbalanced-data examples set it),
30 rows a batch, which 4 GPUs do not divide."""

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

torch.manual_seed(0)
features = torch.randn(120, 4096)
labels = torch.cat([torch.zeros(90), torch.ones(30)]).long()
counts = torch.bincount(labels)
weights = (1.0 / counts.float())[labels]  # each class drawn as often as the other
data = TensorDataset(features, labels)
loader = DataLoader(data, batch_size=30,
                    sampler=WeightedRandomSampler(weights, num_samples=len(data)))

model = nn.Sequential(nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 2))
model = nn.DataParallel(model).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step, (x, y) in enumerate(loader):
    loss = nn.functional.cross_entropy(model(x.cuda()), y.cuda())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step}: {x.shape[0]} rows, loss {loss.item():.3f}")
