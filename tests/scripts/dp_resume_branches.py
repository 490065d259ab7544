"""DataParallel written twice, once after loading a checkpoint and once without, and an
evaluation loader of one image a batch, as VainF's DeepLabV3Plus-Pytorch trains (its code
not copied: the same layout)."""

import argparse
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", default=None)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--val-batch-size", type=int, default=1)
parser.add_argument("--steps", type=int, default=4)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16),
                                  nn.ReLU(), nn.Conv2d(16, 5, 1))

    def forward(self, x):
        return self.body(x)


def main():
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train = TensorDataset(torch.randn(64, 3, 32, 32), torch.randint(0, 5, (64, 32, 32)))
    val = TensorDataset(torch.randn(8, 3, 32, 32), torch.randint(0, 5, (8, 32, 32)))
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val, batch_size=args.val_batch_size, shuffle=True)
    model = Net()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if args.ckpt is not None and os.path.isfile(args.ckpt):
        model.load_state_dict(torch.load(args.ckpt)["model"])
        model = nn.DataParallel(model)
        model.to(device)
    else:
        model = nn.DataParallel(model)
        model.to(device)
    step = 0
    while step < args.steps:
        model.train()
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            outputs = model(images)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 100 == 0:
                model.eval()
                with torch.no_grad():
                    for images, labels in val_loader:
                        model(images.to(device))
            if step == args.steps:
                break


if __name__ == "__main__":
    main()
