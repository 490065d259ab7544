"""The emulator: virtual devices over meta/CPU tensors, DataParallel and DDP re-enacted,
GPU kernels, the caching allocator, the GPU catalog and the one reserved/context model."""
