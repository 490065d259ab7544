"""Resume from a whole model that an earlier run on a GPU pickled (``torch.save(model,
path)``): ``torch.load`` without ``map_location`` puts every tensor back on the GPU it was
saved from, an LSTM's flat weights included."""

import torch

model = torch.load("model.pt", weights_only=False)
print(f"loaded on {next(model.parameters()).device}")
lstm, head = model[0], model[1]
lstm.flatten_parameters()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    x = torch.randn(5, 3, 8, device="cuda")
    out, _ = lstm(x)
    loss = head(out).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
