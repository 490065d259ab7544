"""A small transformer language model in the style of pytorch/examples'
word_language_model (``nn.TransformerEncoder``), on one GPU, in plain float32: no
autocast, no checkpointing. The tokens are made in memory."""

import argparse
import math

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description="Transformer language model")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--bptt", type=int, default=64, help="sequence length")
parser.add_argument("--emsize", type=int, default=256)
parser.add_argument("--nhid", type=int, default=1024)
parser.add_argument("--nlayers", type=int, default=4)
parser.add_argument("--nhead", type=int, default=4)
parser.add_argument("--ntokens", type=int, default=8000)
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(1111)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=512):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class TransformerModel(nn.Module):
    def __init__(self, ntoken, ninp, nhead, nhid, nlayers, dropout=0.2):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.pos_encoder = PositionalEncoding(ninp)
        layer = nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout, batch_first=True)
        self.transformer_encoder = nn.TransformerEncoder(layer, nlayers,
                                                         enable_nested_tensor=False)
        self.decoder = nn.Linear(ninp, ntoken)
        self.ninp = ninp

    def forward(self, src, mask):
        x = self.pos_encoder(self.encoder(src) * math.sqrt(self.ninp))
        return self.decoder(self.transformer_encoder(x, mask=mask, is_causal=True))


model = TransformerModel(args.ntokens, args.emsize, args.nhead, args.nhid,
                         args.nlayers).to(device)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
tokens = torch.randint(args.ntokens, (args.batch_size * (args.bptt + 1) * args.steps,))
mask = nn.Transformer.generate_square_subsequent_mask(args.bptt).to(device)

model.train()
for step in range(args.steps):
    chunk = tokens[step * args.batch_size * (args.bptt + 1):
                   (step + 1) * args.batch_size * (args.bptt + 1)]
    chunk = chunk.view(args.batch_size, args.bptt + 1)
    data, targets = chunk[:, :-1].to(device), chunk[:, 1:].to(device)
    optimizer.zero_grad()
    output = model(data, mask)
    loss = criterion(output.view(-1, args.ntokens), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    optimizer.step()
    print(f"| step {step:3d} | loss {loss.item():5.2f}")
