"""Routed experts streamed from disk: the on-disk layout and its reader (`store`), the bounded
cache of resident expert slots with reads and prefetch (`cache`), and the switch layer that
serves a MoE block from it (`switch`)."""
