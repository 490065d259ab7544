"""Mixed precision the usual way: torch.autocast("cuda") and a GradScaler."""

import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 256)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cuda")
for _ in range(4):
    x = torch.randn(512, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
