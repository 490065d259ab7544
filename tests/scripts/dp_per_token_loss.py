"""DataParallel over a small language model whose loss is kept per token and averaged over
the tokens its padding mask keeps: the loss reduced after it, as masked losses are written."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda:0")
vocab, seq = 1000, 64
model = nn.DataParallel(nn.Sequential(nn.Embedding(vocab, 256), nn.Linear(256, 256), nn.GELU(),
                                      nn.Linear(256, vocab)))
model.to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

tokens = torch.randint(1, vocab, (512, seq + 1))
tokens[:, -8:] = 0  # padding
data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
for ids, targets in DataLoader(data, batch_size=64, shuffle=True):
    ids, targets = ids.to(device), targets.to(device)
    mask = (targets != 0).float()
    logits = model(ids)
    per_token = F.cross_entropy(logits.view(-1, vocab), targets.view(-1), reduction="none")
    loss = (per_token * mask.view(-1)).sum() / mask.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
