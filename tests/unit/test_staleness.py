import pytest

from conveyor.staleness import admissible, may_admit


@pytest.mark.parametrize("issued,bs,version,stale,expected", [
    (0, 4, 0, 0, True),    # first group of step 0 with version 0
    (3, 4, 0, 0, True),    # last group of step 0
    (4, 4, 0, 0, False),   # step 1 must wait for version 1 when synchronous
    (4, 4, 1, 0, True),
    (8, 4, 0, 1, False),   # step 2 needs version >= 1 with staleness 1
    (7, 4, 0, 1, True),    # step 1 may run on version 0 with staleness 1
    (12, 4, 1, 2, True),   # step 3 on version 1: 3 <= 1 + 2
    (16, 4, 1, 2, False),  # step 4 on version 1: 4 > 3
])
def test_may_admit_cases(issued, bs, version, stale, expected):
    assert may_admit(issued, bs, version, stale) is expected


def test_admissible_counts_remaining_slots():
    assert admissible(0, 4, 0, 0) == 4
    assert admissible(3, 4, 0, 0) == 1
    assert admissible(4, 4, 0, 0) == 0
    assert admissible(4, 4, 0, 2) == 8
    assert admissible(20, 4, 0, 2) == 0


def test_admissible_agrees_with_may_admit():
    for issued in range(0, 30):
        for version in range(0, 5):
            for stale in range(0, 3):
                assert (admissible(issued, 3, version, stale) > 0) == may_admit(issued, 3, version, stale)


def test_bad_arguments_named():
    with pytest.raises(ValueError, match="batch_size"):
        may_admit(0, 0, 0, 0)
