"""A public-style ImageNet/CIFAR training script: torchvision's resnet18 in DataParallel."""

import argparse

import torch
import torch.backends.cudnn as cudnn
import torch.nn as nn
import torchvision.models as models
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
parser.add_argument("-b", "--batch-size", default=64, type=int)
parser.add_argument("--lr", default=0.1, type=float)
parser.add_argument("--image-size", default=64, type=int)
args = parser.parse_args()

model = models.resnet18(weights=None)
model = torch.nn.DataParallel(model).cuda()
criterion = nn.CrossEntropyLoss().cuda()
optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
cudnn.benchmark = True

n = args.batch_size * 4
dataset = TensorDataset(torch.randn(n, 3, args.image_size, args.image_size),
                        torch.randint(0, 1000, (n,)))
train_loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                          pin_memory=True)

model.train()
for i, (images, target) in enumerate(train_loader):
    images = images.cuda(non_blocking=True)
    target = target.cuda(non_blocking=True)
    output = model(images)
    loss = criterion(output, target)
    acc1 = (output.argmax(1) == target).float().mean() * 100
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if i % 10 == 0:
        print(f"[{i}/{len(train_loader)}] loss {loss.item():.4f} acc@1 {acc1.item():.2f}")
