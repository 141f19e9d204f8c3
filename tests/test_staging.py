"""Staging slots (experts/staging.py): page-aligned, reused oldest first, and never overwritten
before the installs that read them have run."""

import mlx.core as mx
import numpy as np

from strata_cli.experts.staging import PAGE, SLOTS_PER_CHUNK, StagingArea


def test_slots_are_page_aligned_views_of_one_array_each():
    area = StagingArea(2 * PAGE)
    slots = [area.take() for _ in range(SLOTS_PER_CHUNK + 1)]  # two chunks
    assert area.size == 2 * SLOTS_PER_CHUNK
    for slot in slots:
        host = np.frombuffer(slot.view, dtype=np.uint8)
        assert host.__array_interface__["data"][0] % PAGE == 0 and len(host) == 2 * PAGE
        host[:] = slot.index % 251
        assert np.array(slot.flat).tolist() == host.tolist()  # the device side sees the host's bytes


def test_a_slot_is_overwritten_only_after_the_installs_that_read_it_ran():
    area = StagingArea(PAGE)
    slot = area.take()
    np.frombuffer(slot.view, dtype=np.uint8)[:] = 7
    bank = mx.slice_update(mx.zeros((2, PAGE), dtype=mx.uint8), slot.flat[None], mx.array([1]), axes=(0,))
    area.release(slot, readers=lambda: [bank])  # lazy: the copy has not run
    others = [area.take() for _ in range(SLOTS_PER_CHUNK - 1)]
    again = area.take()  # the oldest released slot: the copy must run before it is handed out
    assert again is slot and area.size == SLOTS_PER_CHUNK
    np.frombuffer(again.view, dtype=np.uint8)[:] = 9  # the reader writes the next record
    assert int(bank[1].max()) == 7 and int(bank[1].min()) == 7
    for other in others:
        area.release(other)


def test_released_slots_are_reused_instead_of_growing():
    area = StagingArea(PAGE)
    for _ in range(5):
        taken = [area.take() for _ in range(SLOTS_PER_CHUNK + 4)]
        for slot in taken:
            area.release(slot)
    assert area.size == 2 * SLOTS_PER_CHUNK
