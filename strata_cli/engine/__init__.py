"""The window engine: per-layer state and every rollback rule (`state`), and run/commit (`window`)."""
