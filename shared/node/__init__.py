"""The node: its GPUs (NVML or simulated), the host's resources, checkpoints on disk, simulated cluster shapes."""
