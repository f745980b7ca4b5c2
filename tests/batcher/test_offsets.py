from batcher.offsets import OffsetTracker


def test_commit_point_stops_at_the_oldest_unfinished_offset() -> None:
    tracker = OffsetTracker()
    for offset in range(5):
        tracker.read(0, offset)
    tracker.finish(0, 0)
    tracker.finish(0, 2)
    assert tracker.committable() == {0: 1}
    tracker.committed({0: 1})
    assert tracker.committable() == {}, "nothing new to commit"
    tracker.finish(0, 1)
    assert tracker.committable() == {0: 3}
    tracker.finish(0, 3)
    tracker.finish(0, 4)
    assert tracker.committable() == {0: 5}
    assert tracker.unfinished() == 0


def test_partitions_are_independent_and_forgettable() -> None:
    tracker = OffsetTracker()
    tracker.read(0, 10)
    tracker.read(1, 7)
    tracker.finish(1, 7)
    assert tracker.committable() == {0: 10, 1: 8}
    tracker.forget(frozenset({0}))
    tracker.committed({1: 8})
    assert tracker.committable() == {}
