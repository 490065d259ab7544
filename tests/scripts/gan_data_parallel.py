"""A GAN in the style of pytorch/examples' dcgan: each network calls
``nn.parallel.data_parallel`` inside its own forward when given several GPUs, the
discriminator three times a step (real, fake detached, fake), the generator once, each with
its own Adam, the real samples from a DataLoader."""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--ngpu", type=int, default=4)
parser.add_argument("--batchSize", type=int, default=32)
opt = parser.parse_args()
NZ, NX = 16, 64
device = torch.device("cuda")


class Generator(nn.Module):
    def __init__(self, ngpu):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(nn.Linear(NZ, 128), nn.ReLU(True), nn.Linear(128, NX),
                                  nn.Tanh())

    def forward(self, input):
        if input.is_cuda and self.ngpu > 1:
            return nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ngpu):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(nn.Linear(NX, 256), nn.LeakyReLU(0.2, inplace=True),
                                  nn.Linear(256, 1), nn.Sigmoid())

    def forward(self, input):
        if input.is_cuda and self.ngpu > 1:
            output = nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        else:
            output = self.main(input)
        return output.view(-1, 1).squeeze(1)


netG = Generator(opt.ngpu).to(device)
netD = Discriminator(opt.ngpu).to(device)
criterion = nn.BCELoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
dataloader = DataLoader(TensorDataset(torch.rand(160, NX)), batch_size=opt.batchSize,
                        shuffle=True)
for i, (data,) in enumerate(dataloader):
    real = data.to(device)
    netD.zero_grad()
    label = torch.full((real.size(0),), 1.0, device=device)
    errD_real = criterion(netD(real), label)
    errD_real.backward()
    fake = netG(torch.randn(real.size(0), NZ, device=device))
    label.fill_(0.0)
    errD_fake = criterion(netD(fake.detach()), label)
    errD_fake.backward()
    optimizerD.step()
    netG.zero_grad()
    label.fill_(1.0)
    errG = criterion(netD(fake), label)
    errG.backward()
    optimizerG.step()
    print(f"[{i}/{len(dataloader)}] Loss_D: {(errD_real + errD_fake).item():.4f}")
