"""The Keras 3 guide "Multi-GPU distributed training with PyTorch": a Keras convnet on the
torch backend, trained with DistributedDataParallel, one process per GPU
(torch.multiprocessing.start_processes). MNIST's arrays as keras.datasets.mnist gives them
(uint8 images and uint8 labels), made in memory here instead of downloaded: the uint8 labels
go to CrossEntropyLoss as they are."""

import os

os.environ["KERAS_BACKEND"] = "torch"

import keras
import numpy as np
import torch

num_gpu = torch.cuda.device_count()
num_epochs = 2
batch_size = 64


def load_mnist():
    """keras.datasets.mnist.load_data()'s arrays and dtypes, without the download."""
    rng = np.random.default_rng(0)
    x_train = rng.integers(0, 256, (512, 28, 28), dtype=np.uint8)
    y_train = rng.integers(0, 10, (512,), dtype=np.uint8)
    x_test = rng.integers(0, 256, (128, 28, 28), dtype=np.uint8)
    y_test = rng.integers(0, 10, (128,), dtype=np.uint8)
    return (x_train, y_train), (x_test, y_test)


def get_model():
    inputs = keras.Input(shape=(28, 28, 1))
    x = keras.layers.Conv2D(filters=12, kernel_size=3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(filters=24, kernel_size=6, use_bias=False, strides=2)(x)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(filters=32, kernel_size=6, padding="same", strides=2,
                            name="large_k")(x)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(256, activation="relu")(x)
    x = keras.layers.Dropout(0.5)(x)
    outputs = keras.layers.Dense(10)(x)
    return keras.Model(inputs, outputs)


def get_dataset():
    (x_train, y_train), (x_test, y_test) = load_mnist()
    x_train = x_train.astype("float32")
    x_test = x_test.astype("float32")
    x = np.concatenate([x_train, x_test], axis=0)
    y = np.concatenate([y_train, y_test], axis=0)
    x = x / 255.0
    x = np.expand_dims(x, -1)
    return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def train_model(model, dataloader, num_epochs, optimizer, loss_fn):
    for epoch in range(num_epochs):
        running_loss = 0.0
        running_loss_count = 0
        for batch_idx, (inputs, targets) in enumerate(dataloader):
            inputs = inputs.cuda(non_blocking=True)
            targets = targets.cuda(non_blocking=True)
            outputs = model(inputs)
            loss = loss_fn(outputs, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            running_loss_count += 1
        print(f"Epoch {epoch + 1}/{num_epochs}, Loss: {running_loss / running_loss_count}")


def setup_device(current_gpu_index, num_gpus):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "56492"
    device = torch.device("cuda:{}".format(current_gpu_index))
    torch.distributed.init_process_group(backend="nccl", init_method="env://",
                                         world_size=num_gpus, rank=current_gpu_index)
    torch.cuda.set_device(device)


def cleanup():
    torch.distributed.destroy_process_group()


def prepare_dataloader(dataset, current_gpu_index, num_gpus, batch_size):
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=num_gpus, rank=current_gpu_index, shuffle=False)
    return torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=batch_size,
                                       shuffle=False)


def per_device_launch_fn(current_gpu_index, num_gpu):
    setup_device(current_gpu_index, num_gpu)
    dataset = get_dataset()
    model = get_model()
    dataloader = prepare_dataloader(dataset, current_gpu_index, num_gpu, batch_size)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    model = model.to(current_gpu_index)
    ddp_model = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[current_gpu_index], output_device=current_gpu_index)
    train_model(ddp_model, dataloader, num_epochs, optimizer, loss_fn)
    cleanup()


if __name__ == "__main__":
    torch.multiprocessing.start_processes(per_device_launch_fn, args=(num_gpu,),
                                          nprocs=num_gpu, join=True, start_method="fork")
