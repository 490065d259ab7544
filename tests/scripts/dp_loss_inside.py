"""DataParallel with the loss computed inside forward: each replica returns its loss."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class NetWithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 256), nn.ReLU())
        self.head = nn.Linear(256, 1000)

    def forward(self, x, y):
        logits = self.head(self.body(x))
        return F.cross_entropy(logits, y)


model = nn.DataParallel(NetWithLoss()).cuda()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(10):
    x = torch.randn(64, 32).cuda(non_blocking=True)
    y = torch.randint(0, 1000, (64,)).cuda(non_blocking=True)
    loss = model(x, y).mean()  # one loss per GPU, averaged on cuda:0
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if step % 5 == 0:
        print(f"step {step}: loss {loss.item():.4f}")
