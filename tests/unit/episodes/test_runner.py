"""``episode_runner`` plays an environment the way it declares (``env.api.PlayedBy``), whatever its
``env.name``: an agent-played one gets the endpoint and the served model's name, a turn-played one
neither, and one that declares an agent but has none is refused before the run."""
import sys
import types
from pathlib import Path

import pytest

from conveyor.config import load_config
from conveyor.data.tiny import build_tokenizer
from conveyor.env.api import PlayedBy
from conveyor.episodes.runner import episode_runner
from conveyor.runtime.errors import SetupError

pytest.importorskip("uvicorn", reason="the agents' endpoint (conveyor[agents])")

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "openai_agent.yaml"


def _runner(overrides):
    cfg = load_config(RECIPE, overrides)
    return episode_runner(cfg, [], build_tokenizer(), 256, lambda: 0, add_special_tokens=False)


@pytest.mark.parametrize("name", ["agent", "conveyor.env.agent:AgentEnv"])
def test_an_agent_played_env_is_served_the_endpoint_by_its_declaration(name):
    runner = _runner([f"env.name={name}", "env.endpoint.model=served"])
    try:
        assert runner.agents is not None and runner.agents.endpoint.base_url.startswith("http://127.0.0.1:")
        assert runner.pool.factory().model == "served"  # the declared model_kwarg
    finally:
        runner.close()


def test_a_turn_played_env_gets_no_endpoint_and_no_model_name():
    runner = _runner(["env.name=guess_number", "env.kwargs={}"])
    try:
        assert runner.agents is None
        assert type(runner.pool.factory()).__name__ == "GuessNumber"
    finally:
        runner.close()


def test_an_env_that_declares_an_agent_but_has_none_is_refused_before_the_run(monkeypatch):
    class NoAgent:
        played_by = PlayedBy("agent", model_kwarg="model")

        def __init__(self, model):
            self.name = model

    monkeypatch.setitem(sys.modules, "declared_envs", types.SimpleNamespace(NoAgent=NoAgent))
    with pytest.raises(SetupError, match=r"^env.name='declared_envs:NoAgent': NoAgent is played by an agent "
                                         r"\(its played_by\) but has no name or entry\(base_url, api_key, task\)"):
        _runner(["env.name=declared_envs:NoAgent", "env.kwargs={}"])
