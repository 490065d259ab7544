"""A LightningModule trained the Lightning way: ``Trainer(strategy="ddp")`` on every GPU,
Lightning starting the other ranks itself, a validation loop, a CSV log and a checkpoint
every few steps kept by ``ModelCheckpoint`` (``--ckpt-dir``)."""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class LitClassifier(L.LightningModule):
    def __init__(self, features: int = 64, hidden: int = 256, classes: int = 10,
                 lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if batch_idx == 0:
            self.print(f"first batch: {tuple(x.shape)} per rank, {self.trainer.world_size} ranks")
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("valid_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("valid_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def dataset(rows: int, features: int, classes: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(rows, features, generator=g),
                         torch.randint(0, classes, (rows,), generator=g))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--ckpt-dir", default="checkpoints")
    parser.add_argument("--log-dir", default="logs")
    args = parser.parse_args()

    L.seed_everything(0)
    model = LitClassifier()
    train = DataLoader(dataset(1024, 64, 10, 1), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(dataset(128, 64, 10, 2), batch_size=args.batch_size)
    checkpoint = ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=2,
                                 save_last=True)
    trainer = L.Trainer(strategy="ddp", devices=args.devices, accelerator="gpu",
                        max_steps=args.max_steps, val_check_interval=2,
                        callbacks=[checkpoint], logger=CSVLogger(args.log_dir),
                        enable_progress_bar=False, enable_model_summary=True)
    trainer.fit(model, train, val)
    if trainer.is_global_zero:
        print("best checkpoint:", checkpoint.best_model_path or checkpoint.last_model_path)


if __name__ == "__main__":
    main()
