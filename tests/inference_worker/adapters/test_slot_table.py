"""SlotTable's kept counts and free-slot heap against a plain scan of its slots, over random
fills, releases, stale marks and pins."""

from __future__ import annotations

import random

from loraserve.inference_worker.adapters.slot_table import SlotTable


def scanned(table: SlotTable) -> dict:
    used = [s for s in table.slots if not s.free]
    return {
        "free": next((s.index for s in table.slots if s.free), None),
        "used": len(used),
        "pinned": sum(1 for s in used if table.is_pinned(s)),
        "by_adapter": {a: [s.index for s in used if s.adapter_id == a] for a in {s.adapter_id for s in used}},
    }


def kept(table: SlotTable) -> dict:
    free = table.free_slot()
    ids = {s.adapter_id for s in table.slots if not s.free}
    return {
        "free": None if free is None else free.index,
        "used": table.num_used,
        "pinned": table.num_pinned,
        "by_adapter": {a: [s.index for s in table.of_adapter(a)] for a in ids},
    }


def test_kept_counts_match_a_scan_of_the_slots() -> None:
    rng = random.Random(3)
    table = SlotTable(12)
    for step in range(3000):
        s = rng.choice(table.slots)
        op = rng.random()
        if op < 0.45:
            aid = f"a{rng.randrange(8)}"
            table.assign(s, f"{aid}@{step}", aid, str(step), 8, 1, step)
        elif op < 0.75:
            table.release_slot(s)
        elif op < 0.85:
            if not s.free:
                table.mark_stale(s)
        elif op < 0.95:
            table.pins.symmetric_difference_update({f"a{rng.randrange(8)}"})
        else:  # fill whatever is free, as a burst of loads does
            while (free := table.free_slot()) is not None:
                table.assign(free, f"b{step}-{free.index}@d", f"b{step}", "d", 8, 1, step)
        assert kept(table) == scanned(table), step


def test_victim_takes_the_lowest_free_slot_before_evicting() -> None:
    table = SlotTable(4)
    for i, s in enumerate(table.slots):
        table.assign(s, f"a{i}@d", f"a{i}", "d", 8, 1, i)
    table.release_slot(table.slots[2])
    table.release_slot(table.slots[1])
    assert table.victim().index == 1
    table.assign(table.slots[1], "x@d", "x", "d", 8, 1, 9)
    assert table.victim().index == 2
    table.assign(table.slots[2], "y@d", "y", "d", 8, 1, 10)
    assert table.victim().index == 0  # none free: the least recently used idle slot


def test_a_heap_of_refilled_slots_is_started_afresh_and_stays_right() -> None:
    """Slots refilled as soon as they empty, with no free-slot question between, push an entry
    each: past four per slot the heap is rebuilt from the slots, and still answers the lowest."""
    table = SlotTable(3)
    for i, s in enumerate(table.slots):
        table.assign(s, f"a{i}@d", f"a{i}", "d", 8, 1, i)
    for step in range(40):
        s = table.slots[step % 3]
        table.release_slot(s)
        table.assign(s, f"b{step}@d", f"b{step}", "d", 8, 1, 10 + step)
        assert len(table._free) <= 4 * 3  # rebuilt when it outgrows that
    assert table.free_slot() is None and table.num_used == 3
    table.release_slot(table.slots[2])
    table.mark_stale(table.slots[2])  # a stale mark on a free slot, cleared when it is emptied again
    table.release_slot(table.slots[0])
    assert table.free_slot().index == 0 and table.num_used == 1
    table.release_slot(table.slots[2])
    assert not table.slots[2].stale and table.free_slot().index == 0
    assert kept(table) == scanned(table)
