"""The window engine: per-layer state, run/commit, and every rollback rule."""
