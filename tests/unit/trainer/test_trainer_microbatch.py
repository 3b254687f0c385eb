import pytest
import torch

from conveyor.trainer.microbatch import collate, plan_microbatches
from conveyor.types import Batch


def test_plan_groups_longest_first_within_padded_budget():
    assert plan_microbatches([3, 5, 2, 5], 10) == [[1, 3], [0, 2]]
    # padded cost: 3 sequences of max length 4 = 12 tokens fit in 12, a fourth would not
    assert plan_microbatches([4, 4, 3, 1], 12) == [[0, 1, 2], [3]]
    assert plan_microbatches([2, 2, 2], 1000) == [[0, 1, 2]]
    assert plan_microbatches([2, 2, 2], 1) == [[0], [1], [2]]
    assert plan_microbatches([], 8) == []


def test_plan_gives_oversized_sequence_its_own_microbatch():
    plan = plan_microbatches([20, 3, 3], 8)
    assert plan == [[0], [1, 2]]
    assert sorted(i for mb in plan for i in mb) == [0, 1, 2]


def test_plan_rejects_nonpositive_budget():
    with pytest.raises(ValueError, match="max_tokens"):
        plan_microbatches([1], 0)


def test_collate_right_pads_every_field():
    batch = Batch(
        input_ids=[torch.tensor([5, 6, 7]), torch.tensor([8])],
        loss_mask=[torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0])],
        fields={"adv": [torch.tensor([0.0, 0.5, -0.5]), torch.tensor([0.0])]},
    )
    mb = collate(batch, [1, 0], pad_id=2)
    assert mb["input_ids"].tolist() == [[8, 2, 2], [5, 6, 7]]
    assert mb["input_ids"].dtype == torch.long
    assert mb["attention_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert mb["loss_mask"].tolist() == [[0.0, 0.0, 0.0], [0.0, 1.0, 1.0]]
    assert mb["loss_mask"].dtype == torch.float32
    assert mb["adv"].tolist() == [[0.0, 0.0, 0.0], [0.0, 0.5, -0.5]]


def test_collate_names_misaligned_field():
    batch = Batch([torch.tensor([1, 2])], [torch.tensor([0.0, 1.0])], {"adv": [torch.tensor([1.0])]})
    with pytest.raises(ValueError, match="sample 0: adv has 1 entries but input_ids has 2"):
        collate(batch, [0], pad_id=0)


def test_pad_multiple_rounds_the_length_and_the_planned_cost():
    # lengths 5 and 5 padded to 8: two rows cost 16 > 12, so they no longer share a micro-batch
    assert plan_microbatches([5, 5], 12) == [[0, 1]]
    assert plan_microbatches([5, 5], 12, multiple=8) == [[0], [1]]
    batch = Batch(input_ids=[torch.tensor([5, 6, 7]), torch.tensor([8])],
                  loss_mask=[torch.tensor([0.0, 1.0, 1.0]), torch.tensor([1.0])],
                  fields={"advantages": [torch.ones(3), torch.ones(1)]})
    mb = collate(batch, [0, 1], pad_id=0, multiple=4)
    assert mb["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert mb["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert mb["advantages"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert collate(batch, [0], pad_id=0, multiple=3)["input_ids"].shape == (1, 3)
