"""The common library of gpufleet: the event contract, the bus, the runtime loop, the store."""
