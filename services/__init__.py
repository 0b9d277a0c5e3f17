"""The eight gpufleet services; each is a pure core (`core.py`) and a thin shell (`__main__.py`)."""
