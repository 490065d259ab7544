"""DataParallel, the PyTorch tutorial's way: the loss is computed outside forward."""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 256)
        self.fc2 = nn.Linear(256, 1000)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


model = Net()
if torch.cuda.device_count() > 1:
    print("Let's use", torch.cuda.device_count(), "GPUs!")
    model = nn.DataParallel(model)
model.to(device)

data = TensorDataset(torch.randn(1024, 32), torch.randint(0, 1000, (1024,)))
loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

for epoch in range(args.epochs):
    running = 0.0
    for i, (inputs, labels) in enumerate(loader):
        inputs, labels = inputs.to(device), labels.to(device)
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = criterion(outputs, labels)
        loss.backward()
        optimizer.step()
        running += loss.item()
        _, predicted = torch.max(outputs, 1)
        if i % 10 == 0:
            print(f"epoch {epoch} step {i} loss {loss.item():.3f}")
    print("epoch", epoch, "loss", running / len(loader))
