"""How an episode is played is the environment's declaration (``env.api.PlayedBy``), read by
``played_by``; an agent's return is read by ``agent_result``."""
import pytest

from conveyor.env.api import TURNS, AgentPlayed, EnvFailure, PlayedBy, agent_result, load_env, played_by
from conveyor.env.tool_env import ToolEnv
from conveyor.runtime.errors import SetupError


def test_the_builtins_declare_how_they_are_played():
    assert played_by(load_env("agent"), "agent") == PlayedBy("agent", model_kwarg="model")
    for name in ("tools", "guess_number"):
        assert played_by(load_env(name), name) is TURNS
    assert played_by(load_env("conveyor.env.agent:AgentEnv"), "x").kind == "agent"  # the class, not its name


def test_an_env_that_declares_nothing_is_played_by_turns_and_a_bad_declaration_is_one_line():
    class Plain:
        def reset(self, task):
            return None

        def step(self, action):
            return "", 0.0, True, {}

    class Bad(Plain):
        played_by = "agent"

    assert played_by(Plain, "p:Plain") is TURNS
    assert played_by(lambda: Plain(), "p:make") is TURNS
    with pytest.raises(SetupError, match=r"^env.name=.p:Bad. declares played_by='agent'; declare a "
                                        r"conveyor.env.api.PlayedBy"):
        played_by(Bad, "p:Bad")


def test_played_by_refuses_an_unknown_kind_and_a_model_name_for_turns():
    with pytest.raises(ValueError, match=r"PlayedBy\(kind='human'\): choose one of \('turns', 'agent'\)"):
        PlayedBy("human")
    with pytest.raises(ValueError, match="only an agent is told the model name"):
        PlayedBy("turns", model_kwarg="model")


def test_an_agent_env_is_agent_played():
    async def solve(base_url, api_key, task):
        return 1.0

    env = load_env("agent")(agent=solve, model="served")
    assert isinstance(env, AgentPlayed) and env.entry is solve and env.model == "served"
    assert not isinstance(ToolEnv(), AgentPlayed)


def test_agent_result_reads_a_float_a_dict_or_none():
    assert agent_result(0.5, "a").reward == 0.5 and agent_result(None, "a").reward is None
    r = agent_result({"reward": 1, "steps": 3, "note": "x", "ok": True}, "a")
    assert (r.reward, dict(r.info)) == (1.0, {"steps": 3.0})
    assert agent_result({"reward": None, "steps": 2}, "a").info == {"steps": 2.0}
    for bad, fragment in (({"score": 1}, "without 'reward'"), ("1", "returned reward '1'"),
                          (float("nan"), "returned reward nan"), (True, "returned reward True")):
        with pytest.raises(EnvFailure, match=fragment) as e:
            agent_result(bad, "agent a")
        assert e.value.kind == "bad_return"
