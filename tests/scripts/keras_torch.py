"""A Keras 3 model trained on the torch backend, with a custom torch training loop."""

import os

os.environ["KERAS_BACKEND"] = "torch"

import keras
import torch

model = keras.Sequential([
    keras.Input(shape=(64,)),
    keras.layers.Dense(512, activation="relu"),
    keras.layers.Dense(10),
])
device = "cuda" if torch.cuda.is_available() else "cpu"
model.to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
loss_fn = torch.nn.CrossEntropyLoss()
for step in range(5):
    x = torch.randn(128, 64, device=device)
    y = torch.randint(0, 10, (128,), device=device)
    optimizer.zero_grad()
    logits = model(x)
    loss = loss_fn(logits, y)
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.4f}")
