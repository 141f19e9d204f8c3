"""Kernels of strata's decode-window hot path.

Each kernel has a pure-MLX reference that the tests hold it to and that runs where the kernel
cannot (the CPU, and backends it has no source for yet). `rows_matvec`: matrix × up to 8 rows,
each row reduced in a fixed order whatever the row count (CUDA). `gdn_window`: the GDN
layer's decode window in two kernels. `attention_window`: a window's query rows over the KV
cache in one kernel, a block per row.
"""
