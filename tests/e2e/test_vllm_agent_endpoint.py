"""The OpenAI-compatible agent endpoint in front of vLLM: the official `openai` client drives a
multi-turn, tool-calling episode, and the recorded trajectory is token-exact with what the API returned.

The same rig as the native-engine tests (tests/unit/episodes/agent_rig.py: the tiny model taught one
calculator episode, an engine served by engine_loop in a thread, the EpisodeRunner with its endpoint),
with the engine a VLLMEngine on that model saved to disk. Runs in the vLLM venv only (docs/vllm.md);
skipped elsewhere.
"""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM venv (docs/vllm.md)")
pytest.importorskip("openai", reason="the agent endpoint's client (docs/agents.md)")

import torch  # noqa: E402

from conveyor.data.tiny import build_model  # noqa: E402
from conveyor.rollout.vllm import VLLMEngine  # noqa: E402

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/tests/unit/episodes")
import agent_rig as R  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """The rig's taught model and tokenizer, saved where vLLM loads them."""
    tok = R.build_tokenizer()
    # vLLM's CPU attention has no kernel for the rig's head size (64 / 4 heads = 16): the same model
    # twice as wide (head size 32, as the other vLLM tests' tiny models). More steps than the native
    # tests: vLLM samples with its own RNG, and the episode must be near-deterministic.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(R, "build_model", lambda tok, **kw: build_model(tok, **{**kw, "hidden_size": 128,
                                                                           "intermediate_size": 256}))
        model = R.taught_model(tok, steps=200)
    path = tmp_path_factory.mktemp("vllm_agent_model")
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return tok, model, str(path)


@pytest.fixture
def vllm_rig(taught, monkeypatch):
    tok, model, path = taught
    engine = VLLMEngine(path, tok, dtype="float32", seed=0, max_model_len=R.CONTEXT,
                        kv_cache_memory_bytes=64 << 20)
    # The rig builds its engine by this name; here it gets the vLLM engine instead of a NativeEngine.
    monkeypatch.setattr(R, "NativeEngine", lambda *a, **k: engine)
    made = []

    def start(agent, **kw):
        r = R.Rig(model, tok, agent, **kw)
        made.append(r)
        return r
    yield start
    for r in made:
        r.close()
    engine.close()


def test_openai_client_tool_episode_on_vllm_is_recorded_token_exact(vllm_rig, taught):
    tok, model, _ = taught
    seen: list = []

    async def agent(base_url, api_key, task):
        return await R.tool_episode(base_url, api_key, task, seen, timeout_s=60)
    r = vllm_rig(agent)
    (traj,) = r.play([R.TASK], timeout_s=180)
    first, second = seen
    # The prompt is the chat template's rendering of the first request; between the turns, the only new
    # tokens are the tool message and the next generation prompt.
    user, recs, turn1 = R.check_tool_replies(tok, seen, traj)
    turn2 = list(traj.completion_ids[recs[1].start:recs[1].end])
    assert turn2 == list(tok(R.ANSWER, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
    whole = R.ids_of(tok, user + [{"role": "assistant", "content": R.CALL}, {"role": "tool", "content": "42"}])
    gap = list(traj.completion_ids[recs[0].end:recs[1].start])
    assert gap == whole[len(traj.prompt_ids) + len(turn1) - 1:]  # the EOS the template does not write back
    # Loss mask: 1 on every policy token, 0 on the tool's tokens; versions: vLLM's weights (0) on the
    # policy tokens, -1 on the tool's.
    n = len(traj.completion_ids)
    assert len(traj.loss_mask) == len(traj.logprobs) == len(traj.versions) == n
    own = [i for i, m in enumerate(traj.loss_mask) if m]
    policy = list(range(recs[0].start, recs[0].end)) + list(range(recs[1].start, recs[1].end))
    assert own == policy
    between = slice(recs[0].end, recs[1].start)
    assert set(traj.loss_mask[between]) == {0} and set(traj.versions[between]) == {-1}
    assert {traj.versions[i] for i in own} == {0}
    # Tokens and logprobs: what the API returned, exactly.
    api_lps = [t.logprob for resp in seen for t in resp.choices[0].logprobs.content]
    assert [traj.logprobs[i] for i in own] == api_lps
    api_tokens = [t.token for resp in seen for t in resp.choices[0].logprobs.content]
    assert [tok.decode([traj.completion_ids[i]], skip_special_tokens=False) for i in own] == api_tokens
    assert first.usage.completion_tokens == len(turn1) and second.usage.completion_tokens == len(turn2)
    assert first.usage.prompt_tokens == len(traj.prompt_ids)
    # vLLM's logprobs are the model's own log-probabilities of the recorded sequence.
    got = R.model_logprobs(model, traj, own)
    assert torch.allclose(got, torch.tensor(api_lps), atol=1e-3, rtol=0), (got - torch.tensor(api_lps)).abs().max()
    assert recs[1].reward == 1.0 and traj.env_return == 1.0 and traj.reward_info == {"calls": 2.0}
    assert r.pool.counts()["agent_calls"] == 2 and r.pool.counts()["episodes"] == 1
