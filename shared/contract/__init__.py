"""The contract: the events, the job spec, the cluster config, ids, subjects and the published schemas."""
