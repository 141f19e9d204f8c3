"""One-off studies and probes: profiles, emulated kernels, fuzzing and measurements behind single findings."""
