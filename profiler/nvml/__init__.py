"""The NVML layer: the only place that imports pynvml; devices matched by UUID; the sampler."""
