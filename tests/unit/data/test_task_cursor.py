"""TaskCursor: seeded epochs, batches across epoch boundaries, exact resume."""
import pytest

from conveyor.data.api import DataError, ListSource, TaskCursor, epoch_order
from conveyor.types import Task

SOURCE = ListSource([Task(f"t{i}", f"p{i}", str(i)) for i in range(5)], default_reward="exact")


def ids(batch):
    return [t.id for t in batch]


def test_each_epoch_is_a_permutation_and_batches_cross_epochs():
    cur = TaskCursor(SOURCE, batch_size=3, seed=7)
    batches = [cur.next_indices() for _ in range(5)]  # 15 tasks = exactly 3 epochs
    flat = [i for b in batches for i in b]
    assert [sorted(flat[k:k + 5]) for k in (0, 5, 10)] == [[0, 1, 2, 3, 4]] * 3
    assert flat[:5] == epoch_order(5, 7, 0) and flat[5:10] == epoch_order(5, 7, 1)
    assert epoch_order(5, 7, 0) != epoch_order(5, 7, 1)  # reshuffled every epoch
    assert cur.state_dict() == {"seed": 7, "epoch": 2, "position": 5, "size": 5}


def test_same_seed_same_order_and_unshuffled_order():
    a = TaskCursor(SOURCE, batch_size=2, seed=1)
    b = TaskCursor(SOURCE, batch_size=2, seed=1)
    assert [ids(a.next_batch()) for _ in range(4)] == [ids(b.next_batch()) for _ in range(4)]
    plain = TaskCursor(SOURCE, batch_size=4, shuffle=False)
    assert ids(plain.next_batch()) == ["t0", "t1", "t2", "t3"]
    assert ids(plain.next_batch()) == ["t4", "t0", "t1", "t2"]


def test_resume_continues_with_exactly_the_same_tasks():
    full = TaskCursor(SOURCE, batch_size=3, seed=11)
    expected = [ids(full.next_batch()) for _ in range(6)]
    first = TaskCursor(SOURCE, batch_size=3, seed=11)
    seen = [ids(first.next_batch()) for _ in range(2)]
    state = dict(first.state_dict())
    resumed = TaskCursor(SOURCE, batch_size=3, seed=0)  # the state carries the seed
    resumed.load_state_dict(state)
    seen += [ids(b) for b, _ in zip(resumed, range(4))]
    assert seen == expected


def test_bad_state_and_empty_source():
    cur = TaskCursor(SOURCE, batch_size=2)
    with pytest.raises(DataError, match="saved for 9 tasks but the source has 5"):
        cur.load_state_dict({"seed": 0, "epoch": 0, "position": 0, "size": 9})
    with pytest.raises(DataError, match=r"missing \['position'\]"):
        cur.load_state_dict({"seed": 0, "epoch": 0, "size": 5})
    with pytest.raises(DataError, match="task source is empty"):
        TaskCursor(ListSource([]), batch_size=2)
