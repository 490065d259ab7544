"""A Hugging Face Trainer script: a small BERT built from its config (no download), a
Dataset made in memory, TrainingArguments from the command line. With several GPUs in one
process, Trainer wraps the model in nn.DataParallel itself (args.n_gpu > 1) and averages the
replicas' losses."""

import argparse

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class RandomTextDataset(Dataset):
    def __init__(self, n, seq_len, vocab_size, num_labels, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, vocab_size, (n, seq_len), generator=g)
        self.labels = torch.randint(0, num_labels, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i],
                "attention_mask": torch.ones_like(self.input_ids[i]),
                "labels": self.labels[i]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--seq_len", type=int, default=32)
    args = parser.parse_args()

    config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=64, num_labels=3)
    model = BertForSequenceClassification(config)
    train_dataset = RandomTextDataset(256, args.seq_len, config.vocab_size, config.num_labels)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_train_batch_size,
        max_steps=args.max_steps,
        learning_rate=5e-5,
        logging_steps=2,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset)
    print("n_gpu", training_args.n_gpu, "train batch", training_args.train_batch_size)
    result = trainer.train()
    print("global step", result.global_step)


if __name__ == "__main__":
    main()
