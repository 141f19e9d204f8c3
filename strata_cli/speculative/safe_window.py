"""Window sizing: how many rows (root + drafts) one verification run may take.

Plain Python: no MLX import.
"""

# Cells per sparse-attention (QSA) indexer block: the tail pools a block key when
# cell ``pos % QSA_BLOCK == QSA_BLOCK - 1`` is written.
QSA_BLOCK = 4


def safe_window(
    *, num_drafts: int, remaining_tokens: int, context_left: int, pos0: int, block_cap: bool,
    block: int = QSA_BLOCK,
) -> int:
    """Largest window size ``T`` (root + drafts) that is safe to run at ``pos0``.

    ``T`` is the minimum of these bounds:

    - ``1 + num_drafts``: the root plus every available draft.
    - ``remaining_tokens``: a window can emit up to ``T`` tokens (the kept
      outputs plus the bonus), so it must fit the ``max_tokens`` budget.
    - ``context_left``: the window writes positions ``pos0 .. pos0+T-1``, so they
      must all fit in the context.
    - ``block - pos0 % block``, only when ``block_cap``: the QSA indexer
      tail holds the raw keys of the incomplete 4-cell block and is not
      positional (and a compressor's ring, DeepSeek-V4, those of its open
      window and the one before it: ``block`` is its compress rate). A window that crosses a block boundary overwrites tail slots
      of committed cells, and rejecting drafts cannot bring them back. Inside
      one block, rejected slots are rewritten before the block's key is pooled.
      Engines that snapshot and replay the tail do not need this cap.

    Args:
        num_drafts (int): Drafts available (``>= 0``).
        remaining_tokens (int): Tokens still allowed by ``max_tokens``.
        context_left (int): Positions still free at and after ``pos0``.
        pos0 (int): Absolute position of the root (``>= 0``).
        block_cap (bool): Whether the engine has a QSA indexer tail and no tail
            rollback.
        block (int): Cells per block (default ``QSA_BLOCK``).

    Returns:
        int: ``T``. ``0`` when ``remaining_tokens <= 0`` or ``context_left <= 0``
        (nothing can run), otherwise at least ``1``.
    """
    if num_drafts < 0:
        raise ValueError(f"num_drafts ({num_drafts}) must be non-negative")
    if pos0 < 0:
        raise ValueError(f"pos0 ({pos0}) must be non-negative")
    if remaining_tokens <= 0 or context_left <= 0:
        return 0
    size = min(1 + num_drafts, remaining_tokens, context_left)
    if block_cap:
        size = min(size, block - pos0 % block)
    return size
