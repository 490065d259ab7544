"""Device-agnostic code through torch.accelerator (torch >= 2.6)."""

import torch
import torch.nn as nn

device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"
print("training on", device, "x", torch.accelerator.device_count())
if torch.accelerator.is_available():
    torch.accelerator.set_device_index(0)
model = nn.Sequential(nn.Linear(128, 1024), nn.GELU(), nn.Linear(1024, 10)).to(device)
optimizer = torch.optim.Adam(model.parameters())
for _step in range(4):
    x = torch.randn(256, 128, device=device)
    y = torch.randint(0, 10, (256,), device=device)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
        print("allocated", torch.accelerator.memory_allocated(), "peak",
              torch.accelerator.max_memory_allocated())
