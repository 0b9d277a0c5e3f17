"""The read side: the cluster view as a fold of the log, and its PostgreSQL read model."""
