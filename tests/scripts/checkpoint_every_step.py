"""A DataParallel script that resumes from its checkpoint file when there is one and writes
it again after every optimizer step (model, optimizer, step), with a plain progress log."""

import argparse
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", default="checkpoint.pt")
parser.add_argument("--steps", type=int, default=8)
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1000)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
start = 0
if os.path.exists(args.ckpt):
    state = torch.load(args.ckpt, map_location=device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = state["step"] + 1
    print(f"resumed from {args.ckpt} at step {start}")
if torch.cuda.device_count() > 1:
    model = nn.DataParallel(model)
criterion = nn.CrossEntropyLoss()
data = TensorDataset(torch.randn(512, 32), torch.randint(0, 1000, (512,)))
loader = DataLoader(data, batch_size=64, shuffle=True)

step = start
for inputs, labels in loader:
    if step >= start + args.steps:
        break
    inputs, labels = inputs.to(device), labels.to(device)
    optimizer.zero_grad()
    outputs = model(inputs)
    loss = criterion(outputs, labels)
    loss.backward()
    optimizer.step()
    raw = model.module if isinstance(model, nn.DataParallel) else model
    torch.save({"model": raw.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
               args.ckpt)
    print(f"step {step} saved")
    step += 1
