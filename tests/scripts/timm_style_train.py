#!/usr/bin/env python3
"""Image-classification training in timm's way: a model from timm's registry (built from
its config, no weights), timm's dataset and loader over an image folder
(``<data-dir>/train/<class>/*.png``), timm's optimizer factory, the loss on the gathered
outputs, a top-1 validation pass under ``torch.inference_mode()``, and a checkpoint per
epoch kept by timm's ``CheckpointSaver`` (written to a temporary file, then renamed over
``last.pth.tar`` and linked as ``checkpoint-<epoch>.pth.tar``). Several GPUs: DataParallel.
"""

import argparse
import logging
import os
import time

import torch
import torch.nn as nn
from timm import create_model
from timm.data import create_dataset, create_loader, resolve_data_config
from timm.optim import create_optimizer_v2
from timm.utils import AverageMeter, CheckpointSaver, accuracy, setup_default_logging

_logger = logging.getLogger("train")

parser = argparse.ArgumentParser(description="timm-style ImageNet-like training")
parser.add_argument("--data-dir", metavar="DIR", required=True,
                    help="path to the dataset (train/ and optionally validation/ inside)")
parser.add_argument("--model", default="test_resnet", type=str, metavar="MODEL",
                    help="name of the model to train (default: test_resnet)")
parser.add_argument("--num-classes", type=int, default=None, metavar="N",
                    help="number of label classes (default: the folder's)")
parser.add_argument("--img-size", type=int, default=None, metavar="N",
                    help="image size (default: the model's)")
parser.add_argument("-b", "--batch-size", type=int, default=32, metavar="N")
parser.add_argument("--epochs", type=int, default=2, metavar="N")
parser.add_argument("--opt", default="sgd", type=str, metavar="OPTIMIZER")
parser.add_argument("--lr", type=float, default=0.05, metavar="LR")
parser.add_argument("--momentum", type=float, default=0.9, metavar="M")
parser.add_argument("--weight-decay", type=float, default=2e-5)
parser.add_argument("-j", "--workers", type=int, default=4, metavar="N",
                    help="how many training processes to use (default: 4)")
parser.add_argument("--num-gpu", type=int, default=None,
                    help="number of GPUs to use (default: all visible)")
parser.add_argument("--output", default="./output", type=str, metavar="PATH",
                    help="path to the output folder (default: ./output)")
parser.add_argument("--log-interval", type=int, default=1, metavar="N")


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args):
    losses_m = AverageMeter()
    model.train()
    end = time.time()
    for batch_idx, (input, target) in enumerate(loader):
        input, target = input.cuda(), target.cuda()
        output = model(input)
        loss = loss_fn(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses_m.update(loss.item(), input.size(0))
        if batch_idx % args.log_interval == 0:
            _logger.info(f"Train: {epoch} [{batch_idx:>4d}/{len(loader)}] "
                         f"Loss: {losses_m.val:#.3g} ({losses_m.avg:#.3g}) "
                         f"Time: {time.time() - end:.3f}s")
        end = time.time()
    return {"loss": losses_m.avg}


def validate(model, loader, loss_fn):
    losses_m, top1_m = AverageMeter(), AverageMeter()
    model.eval()
    with torch.inference_mode():
        for input, target in loader:
            input, target = input.cuda(), target.cuda()
            output = model(input)
            loss = loss_fn(output, target)
            (acc1,) = accuracy(output, target, topk=(1,))
            losses_m.update(loss.item(), input.size(0))
            top1_m.update(acc1.item(), output.size(0))
    return {"loss": losses_m.avg, "top1": top1_m.avg}


def main():
    setup_default_logging()
    args = parser.parse_args()
    args.num_gpu = args.num_gpu or torch.cuda.device_count()

    dataset_train = create_dataset("", root=args.data_dir, split="train", is_training=True,
                                   batch_size=args.batch_size)
    dataset_eval = create_dataset("", root=args.data_dir, split="validation",
                                  is_training=False, batch_size=args.batch_size)
    num_classes = args.num_classes or len(dataset_train.reader.class_to_idx)

    model = create_model(args.model, pretrained=False, num_classes=num_classes)
    data_config = resolve_data_config(
        {"input_size": (3, args.img_size, args.img_size)} if args.img_size else {}, model=model)
    _logger.info(f"Model {args.model} created, param count: "
                 f"{sum(m.numel() for m in model.parameters())}")

    if args.num_gpu > 1:
        model = nn.DataParallel(model, device_ids=list(range(args.num_gpu))).cuda()
    else:
        model.cuda()
    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr,
                                    weight_decay=args.weight_decay, momentum=args.momentum)

    loader_train = create_loader(
        dataset_train, input_size=data_config["input_size"], batch_size=args.batch_size,
        is_training=True, use_prefetcher=False, no_aug=True, mean=data_config["mean"],
        std=data_config["std"], num_workers=args.workers)
    loader_eval = create_loader(
        dataset_eval, input_size=data_config["input_size"], batch_size=args.batch_size,
        is_training=False, use_prefetcher=False, mean=data_config["mean"],
        std=data_config["std"], num_workers=args.workers, crop_pct=data_config["crop_pct"])

    train_loss_fn = nn.CrossEntropyLoss().cuda()
    validate_loss_fn = nn.CrossEntropyLoss().cuda()

    os.makedirs(args.output, exist_ok=True)
    saver = CheckpointSaver(model=model, optimizer=optimizer, args=args,
                            checkpoint_dir=args.output, recovery_dir=args.output,
                            decreasing=False, max_history=2)
    for epoch in range(args.epochs):
        train_metrics = train_one_epoch(epoch, model, loader_train, optimizer, train_loss_fn,
                                        args)
        eval_metrics = validate(model, loader_eval, validate_loss_fn)
        best_metric, best_epoch = saver.save_checkpoint(epoch, metric=eval_metrics["top1"])
        _logger.info(f"epoch {epoch}: train loss {train_metrics['loss']:.4f}, "
                     f"top-1 {eval_metrics['top1']:.2f} (best {best_metric:.2f} "
                     f"at epoch {best_epoch})")


if __name__ == "__main__":
    main()
