"""The backends that run a scenario: emulated (virtual devices), cpu (real CPU tensors, gloo
DDP ranks), cuda (real GPUs, NCCL DDP ranks), and the rank layer they share."""
