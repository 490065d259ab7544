"""A word-level LSTM language model in the style of pytorch/examples' word_language_model:
plain SGD on the parameters (no optimizer object), truncated backpropagation through time,
the whole model written with ``open(path, "wb")`` + ``torch.save(model, f)`` whenever the
validation loss improves."""

import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--save", default="model.pt")
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

NTOKEN, EMSIZE, NHID, NLAYERS, BATCH, BPTT = 50, 16, 16, 2, 4, 8


class RNNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(NTOKEN, EMSIZE)
        self.rnn = nn.LSTM(EMSIZE, NHID, NLAYERS)
        self.decoder = nn.Linear(NHID, NTOKEN)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        decoded = self.decoder(output).view(-1, NTOKEN)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(NLAYERS, bsz, NHID), weight.new_zeros(NLAYERS, bsz, NHID))


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous().to(device)


def get_batch(source, i):
    seq_len = min(BPTT, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].view(-1)


def evaluate(model, source):
    model.eval()
    total, hidden = 0.0, model.init_hidden(BATCH)
    with torch.no_grad():
        for i in range(0, source.size(0) - 1, BPTT):
            data, targets = get_batch(source, i)
            output, hidden = model(data, hidden)
            total += len(data) * criterion(output, targets).item()
    return total / (len(source) - 1)


device = torch.device("cuda")
g = torch.Generator().manual_seed(0)
train_data = batchify(torch.randint(0, NTOKEN, (200,), generator=g), BATCH)
val_data = batchify(torch.randint(0, NTOKEN, (40,), generator=g), BATCH)
model = RNNModel().to(device)
criterion = nn.NLLLoss()
lr, best_val_loss = 20.0, None
for epoch in range(1, args.epochs + 1):
    model.train()
    hidden = model.init_hidden(BATCH)
    for i in range(0, train_data.size(0) - 1, BPTT):
        data, targets = get_batch(train_data, i)
        hidden = tuple(h.detach() for h in hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        criterion(output, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
    val_loss = evaluate(model, val_data)
    print(f"end of epoch {epoch}")
    if not best_val_loss or val_loss < best_val_loss:
        with open(args.save, "wb") as f:
            torch.save(model, f)
        best_val_loss = val_loss

