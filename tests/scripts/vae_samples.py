"""Sample images written as pytorch/examples' VAE and dcgan write them (torchvision's
``save_image``: a grid made on the host, scaled, ``Image.fromarray(...).save``), spelled out
with Pillow: a reconstruction grid made from a host copy of the GPU's output, a sample saved
straight from the GPU, and a picture of the host's own data."""

import numpy as np
import torch
import torch.nn as nn
from PIL import Image

device = torch.device("cuda")
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 28 * 28), nn.Sigmoid())
model.to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(3):
    x = torch.randn(8, 20).to(device)
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def save_grid(images, path):
    """torchvision's make_grid + save_image for 28x28 images, one row."""
    grid = torch.zeros(28, 28 * len(images))
    for k, image in enumerate(images):
        grid.narrow(1, 28 * k, 28).copy_(image.view(28, 28))
    ndarr = grid.mul(255).add_(0.5).clamp_(0, 255).to("cpu", torch.uint8).numpy()
    Image.fromarray(ndarr).save(path)


with torch.no_grad():
    recon = model(torch.randn(4, 20).to(device)).cpu()
    save_grid(recon, "reconstruction.png")
    sample = model(torch.randn(1, 20).to(device)).view(28, 28)
    Image.fromarray(sample.mul(255).to("cpu", torch.uint8).numpy()).save("sample.png")
Image.fromarray(np.full((28, 28), 200, dtype=np.uint8)).save("host.png")
print("saved")
