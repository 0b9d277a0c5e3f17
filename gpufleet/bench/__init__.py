"""The benchmarks (`gpufleet bench ...`); figures go to docs/benchmarks.md."""
