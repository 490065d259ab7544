"""Image classification in the way of torchvision's classification reference: an
``ImageFolder`` at ``<data-path>/train`` and ``<data-path>/val``, a model from
``torchvision.models`` (no weights), SGD with label smoothing and a step LR, a
checkpoint per epoch written by the main process only. Started by torchrun (``RANK`` set)
it is DistributedDataParallel with a DistributedSampler; otherwise DataParallel over the
visible GPUs (one GPU: the model as it is)."""

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.utils.data
import torchvision
from torch import nn
from torchvision import transforms


def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def is_main_process():
    return not is_dist_avail_and_initialized() or dist.get_rank() == 0


def save_on_master(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)


def init_distributed_mode(args):
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ["WORLD_SIZE"])
        args.gpu = int(os.environ["LOCAL_RANK"])
    else:
        print("Not using distributed mode")
        args.distributed = False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    print(f"| distributed init (rank {args.rank})", flush=True)
    dist.init_process_group(backend="nccl", world_size=args.world_size, rank=args.rank)
    dist.barrier()


def load_data(traindir, valdir, args):
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    dataset = torchvision.datasets.ImageFolder(traindir, transforms.Compose([
        transforms.RandomResizedCrop(args.train_crop_size),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        normalize,
    ]))
    dataset_test = torchvision.datasets.ImageFolder(valdir, transforms.Compose([
        transforms.Resize(args.val_resize_size),
        transforms.CenterCrop(args.val_crop_size),
        transforms.ToTensor(),
        normalize,
    ]))
    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(dataset)
        test_sampler = torch.utils.data.distributed.DistributedSampler(dataset_test,
                                                                       shuffle=False)
    else:
        train_sampler = torch.utils.data.RandomSampler(dataset)
        test_sampler = torch.utils.data.SequentialSampler(dataset_test)
    return dataset, dataset_test, train_sampler, test_sampler


def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args):
    model.train()
    start_time = time.time()
    for i, (image, target) in enumerate(data_loader):
        image, target = image.to(device), target.to(device)
        output = model(image)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % args.print_freq == 0:
            print(f"Epoch: [{epoch}] [{i}/{len(data_loader)}] loss: {loss.item():.4f} "
                  f"lr: {optimizer.param_groups[0]['lr']:.4f} "
                  f"time: {time.time() - start_time:.3f}s")


def evaluate(model, criterion, data_loader, device):
    model.eval()
    correct, seen = 0, 0
    with torch.inference_mode():
        for image, target in data_loader:
            image, target = image.to(device, non_blocking=True), target.to(device)
            output = model(image)
            criterion(output, target)
            correct += (output.argmax(1) == target).sum().item()
            seen += image.shape[0]
    acc1 = 100.0 * correct / max(seen, 1)
    print(f"Test: Acc@1 {acc1:.3f}")
    return acc1


def main(args):
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
    init_distributed_mode(args)
    print(args)
    device = torch.device(args.device)

    train_dir = os.path.join(args.data_path, "train")
    val_dir = os.path.join(args.data_path, "val")
    dataset, dataset_test, train_sampler, test_sampler = load_data(train_dir, val_dir, args)
    num_classes = len(dataset.classes)
    data_loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
        pin_memory=True, drop_last=True)
    data_loader_test = torch.utils.data.DataLoader(
        dataset_test, batch_size=args.batch_size, sampler=test_sampler,
        num_workers=args.workers, pin_memory=True)

    print("Creating model")
    model = torchvision.models.get_model(args.model, weights=None, num_classes=num_classes)
    model.to(device)

    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.lr_step_size,
                                                   gamma=args.lr_gamma)

    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module
    elif torch.cuda.device_count() > 1:
        model = torch.nn.DataParallel(model)
        model_without_ddp = model.module

    print("Start training")
    start_time = time.time()
    for epoch in range(args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args)
        lr_scheduler.step()
        evaluate(model, criterion, data_loader_test, device=device)
        if args.output_dir:
            checkpoint = {
                "model": model_without_ddp.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(),
                "epoch": epoch,
                "args": args,
            }
            save_on_master(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))
            save_on_master(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))
    total_time = time.time() - start_time
    print(f"Training time {datetime.timedelta(seconds=int(total_time))}")


def get_args_parser(add_help=True):
    parser = argparse.ArgumentParser(description="PyTorch Classification Training",
                                     add_help=add_help)
    parser.add_argument("--data-path", default="/datasets01/imagenet_full_size/061417/",
                        type=str, help="dataset path")
    parser.add_argument("--model", default="resnet18", type=str, help="model name")
    parser.add_argument("--device", default="cuda", type=str, help="device (cuda or cpu)")
    parser.add_argument("-b", "--batch-size", default=32, type=int,
                        help="images per gpu, the total batch size is $NGPU x batch_size")
    parser.add_argument("--epochs", default=90, type=int, metavar="N")
    parser.add_argument("-j", "--workers", default=16, type=int, metavar="N",
                        help="number of data loading workers (default: 16)")
    parser.add_argument("--lr", default=0.1, type=float, help="initial learning rate")
    parser.add_argument("--momentum", default=0.9, type=float, metavar="M")
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, metavar="W",
                        dest="weight_decay")
    parser.add_argument("--label-smoothing", default=0.0, type=float)
    parser.add_argument("--lr-step-size", default=30, type=int)
    parser.add_argument("--lr-gamma", default=0.1, type=float)
    parser.add_argument("--print-freq", default=10, type=int, help="print frequency")
    parser.add_argument("--output-dir", default=".", type=str, help="path to save outputs")
    parser.add_argument("--val-resize-size", default=256, type=int)
    parser.add_argument("--val-crop-size", default=224, type=int)
    parser.add_argument("--train-crop-size", default=224, type=int)
    return parser


if __name__ == "__main__":
    main(get_args_parser().parse_args())
