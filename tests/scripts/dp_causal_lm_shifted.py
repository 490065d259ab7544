"""A causal language model under nn.DataParallel whose loss shifts the logits against the
tokens, as Hugging Face's models do inside forward, written here in the training loop:
``criterion(logits[:, :-1].transpose(1, 2), ids[:, 1:])``, with label smoothing and the pad
token ignored. The batches are made in the loop (no DataLoader), padded at their ends."""

import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description="causal LM, shifted loss, DataParallel")
parser.add_argument("--batch-size", type=int, default=30)
parser.add_argument("--seq-len", type=int, default=33)
parser.add_argument("--vocab", type=int, default=2048)
parser.add_argument("--d-model", type=int, default=64)
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

PAD = 0
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class TinyLM(nn.Module):
    def __init__(self, vocab, d_model):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0,
                                           batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.lm_head = nn.Linear(d_model, vocab)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1), device=ids.device)
        return self.lm_head(self.body(self.embed(ids), mask=mask, is_causal=True))


model = nn.DataParallel(TinyLM(args.vocab, args.d_model).to(device))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
criterion = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)

for step in range(args.steps):
    ids = torch.randint(1, args.vocab, (args.batch_size, args.seq_len), device=device)
    lengths = torch.randint(args.seq_len // 2, args.seq_len + 1, (args.batch_size, 1),
                            device=device)
    ids = ids.masked_fill(torch.arange(args.seq_len, device=device) >= lengths, PAD)
    logits = model(ids)
    loss = criterion(logits[:, :-1].transpose(1, 2).float(), ids[:, 1:])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.4f}")
