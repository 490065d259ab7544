"""`dpprof watch`: an NVML timeline of any command on real GPUs."""
