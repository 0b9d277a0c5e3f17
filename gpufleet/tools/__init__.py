"""The log tools: replay's view snapshots, what-if and the simulator, the audit, the dashboard."""
