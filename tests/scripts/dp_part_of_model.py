"""DataParallel around a part of the model, as pytorch/examples' ImageNet script wraps VGG's
and AlexNet's convolutions: ``model.features = nn.DataParallel(model.features)``, the large
classifier run on cuda:0 alone, on the gathered features."""

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(8))
        self.classifier = nn.Sequential(nn.Linear(64 * 8 * 8, 2048), nn.ReLU(),
                                        nn.Linear(2048, 100))

    def forward(self, x):
        x = self.features(x)
        return self.classifier(torch.flatten(x, 1))


model = Net()
model.features = nn.DataParallel(model.features)
model.cuda()
rows = 32
criterion = nn.CrossEntropyLoss().cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for step in range(4):
    images = torch.randn(rows, 3, 32, 32).cuda()
    target = torch.randint(0, 100, (rows,)).cuda()
    output = model(images)
    loss = criterion(output, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
