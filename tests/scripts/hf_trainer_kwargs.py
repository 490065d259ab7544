"""A Hugging Face Trainer-style loop: the batch is a dict, passed as keyword arguments
(``model(**inputs)``, Trainer.compute_loss); the model computes its loss from ``labels`` and
returns a dict; with several GPUs the model is wrapped in nn.DataParallel and the replicas'
losses are averaged (``loss.mean()``, as Trainer does when n_gpu > 1). The model is built
from a config, the data made in memory."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


@dataclass
class Config:
    vocab_size: int = 1000
    hidden_size: int = 64
    max_position_embeddings: int = 32
    num_labels: int = 4


class SequenceClassifier(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.encoder = nn.Sequential(nn.Linear(config.hidden_size, 4 * config.hidden_size),
                                     nn.GELU(), nn.Linear(4 * config.hidden_size,
                                                          config.hidden_size))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.embeddings(input_ids) + self.position_embeddings(positions)
        hidden = self.encoder(hidden) * attention_mask.unsqueeze(-1)
        pooled = hidden.sum(1) / attention_mask.sum(1, keepdim=True)
        logits = self.classifier(pooled)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


class TextDataset(Dataset):
    def __init__(self, n, seq_len, config):
        g = torch.Generator().manual_seed(0)
        self.input_ids = torch.randint(0, config.vocab_size, (n, seq_len), generator=g)
        self.labels = torch.randint(0, config.num_labels, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i],
                "attention_mask": torch.ones_like(self.input_ids[i]),
                "labels": self.labels[i]}


def main():
    config = Config()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = SequenceClassifier(config).to(device)
    n_gpu = torch.cuda.device_count()
    if n_gpu > 1:
        model = nn.DataParallel(model)
    loader = DataLoader(TextDataset(256, 32, config), batch_size=62)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    model.train()
    for step, inputs in enumerate(loader):
        inputs = {k: v.to(device) for k, v in inputs.items()}
        outputs = model(**inputs)
        loss = outputs["loss"]
        if n_gpu > 1:
            loss = loss.mean()  # mean() to average on multi-gpu parallel training
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 2 == 0:
            print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
