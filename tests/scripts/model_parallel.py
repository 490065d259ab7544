"""Model parallelism as in the PyTorch tutorial: net1 on cuda:0, net2 on cuda:1."""

import torch
import torch.nn as nn
import torch.optim as optim


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = torch.nn.Linear(1000, 2000).to("cuda:0")
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(2000, 500).to(torch.device("cuda", 1))

    def forward(self, x):
        x = self.relu(self.net1(x.to("cuda:0")))
        return self.net2(x.to("cuda:1"))


model = ToyModel()
loss_fn = nn.MSELoss()
optimizer = optim.SGD(model.parameters(), lr=0.001)

for _ in range(5):
    optimizer.zero_grad()
    outputs = model(torch.randn(128, 1000))
    labels = torch.randn(128, 500).to("cuda:1")
    loss_fn(outputs, labels).backward()
    optimizer.step()
print("max allocated per GPU:",
      [torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())])
