"""Speculative decoding helpers: drafting, window sizing, control and acceptance (plain Python)."""
