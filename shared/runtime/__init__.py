"""The runtime: the bus, the engine, the service loop, reading the log, snapshots, leases, retention and the archive, telemetry of the mesh itself."""
