"""gpufleet: a control plane for AI work on heterogeneous CPU + GPU clusters, on one event log."""

__version__ = "0.1.0"
