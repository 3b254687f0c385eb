"""The recording of an agent's calls: the rendered request is matched against the recorded tokens and only the
suffix is appended; a stop token the template does not write back, and a reply the tokenizer would split
differently, still match; a rewritten history starts a new segment and the episode is refused; budgets."""
import pytest

from conveyor.env.pool import EnvFailure
from conveyor.episodes.multi_turn import EpisodeLimits
from conveyor.episodes.transcript import Span, Transcript, match_prefix
from conveyor.rollout.api import Completion
from conveyor.types import Task

# A toy vocabulary: one id per piece; 9 is EOS, 7 is "ab" (a merge of 1 "a" and 2 "b").
VOCAB = {1: "a", 2: "b", 3: "<u>", 4: "<as>", 5: "\n", 6: "<t>", 7: "ab", 8: "c", 9: "</s>"}
EOS = 9


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def text(ids):
    return "".join(VOCAB[i] for i in ids if i != EOS)


def done(ids, reason="stop"):
    return Completion(list(ids), [-0.5] * len(ids), [3] * len(ids), reason)


def test_exact_prefix_appends_only_the_suffix_and_skips_an_eos_the_template_drops():
    t = Transcript(EpisodeLimits(4, 100, 10, 50), decode, text)
    first = [3, 8, 4]                                     # <u>c<as>
    assert t.extend(first, t.covered(first))
    t.add(done([1, 2, EOS]), {EOS}, ("calc",))            # the model: "ab</s>"
    # The template renders the reply without the EOS, then the tool message and the generation prompt.
    second = first + [1, 2, 5, 6, 8, 5, 4]
    assert t.covered(second) == 5 and t.extend(second, 5)
    assert t.ids == first + [1, 2, EOS, 5, 6, 8, 5, 4]   # the EOS the model sampled stays
    t.add(done([8, EOS]), {EOS})
    traj = t.trajectory(Task("x", "c"), finish_reason="stop", reward=1.0, info={"k": 2.0})
    assert traj.loss_mask == (1, 1, 1, 0, 0, 0, 0, 0, 1, 1) and traj.versions[3:8] == (-1,) * 5
    assert traj.logprobs[:3] == (-0.5,) * 3 and traj.logprobs[3:8] == (0.0,) * 5
    assert [(r.start, r.end) for r in traj.turn_records] == [(0, 3), (8, 10)]
    assert traj.turn_records[0].tool_calls == ("calc",) and traj.env_return == 1.0 and traj.reward_info == {"k": 2.0}
    assert traj.text == "ab\n<t>c\n<as>c"


def test_a_template_that_writes_the_stop_token_back_and_a_differently_split_reply_match():
    recorded = [3, 4, 1, 2, EOS]
    spans = [Span(2, 5, EOS)]
    assert match_prefix(recorded, spans, [3, 4, 1, 2, EOS, 5, 4], decode) == 5
    # The tokenizer now writes "ab" as one token: same text, so the reply matches (its sampled ids stay).
    assert match_prefix(recorded, spans, [3, 4, 7, 5, 4], decode) == 3
    assert match_prefix(recorded, spans, [3, 4, 1, 8, 5], decode) is None          # the reply was edited
    assert match_prefix(recorded, spans, [3, 8, 1, 2, 5], decode) is None          # the prompt was edited
    assert match_prefix(recorded, spans, [3, 4, 1], decode) is None                # history dropped


def test_a_rewrite_starts_a_new_segment_and_the_episode_is_refused():
    t = Transcript(EpisodeLimits(4, 100, 10, 50), decode, text)
    t.extend([3, 8, 4], 0)
    t.add(done([1, 2, EOS]), {EOS})
    rewritten = [3, 8, 4, 8, 8, 5, 4]
    assert t.covered(rewritten) is None and not t.extend(rewritten, None)
    assert t.rewrites == 1 and t.ids == rewritten      # the client is still served from its own render
    with pytest.raises(EnvFailure, match="did not continue its recorded tokens") as e:
        t.trajectory(Task("x", "c"), finish_reason="stop")
    assert e.value.kind == "history_rewritten"


def test_budgets_cut_a_reply_and_count_room():
    t = Transcript(EpisodeLimits(4, 6, 10, 8), decode, text)      # context 8, 6 completion tokens
    t.extend([3, 8, 4], 0)
    assert t.room() == 5 and t.room_after([3, 8, 4, 1], 3) == 4
    t.add(done([1, 2, 1, 2, 1, 2, 1], "length"), {EOS})            # cut to what the context allows
    assert t.ids == [3, 8, 4, 1, 2, 1, 2, 1] and t.room() == 0
    with pytest.raises(EnvFailure, match="made no model call") as e:
        Transcript(EpisodeLimits(4, 6, 10, 8), decode, text).trajectory(Task("y", "c"), finish_reason="stop")
    assert e.value.kind == "bad_return"
