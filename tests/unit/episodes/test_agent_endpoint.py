"""Agents through the OpenAI-compatible endpoint, driven by the real clients: the `openai` package and the
OpenAI Agents SDK, against a real NativeEngine (tests/unit/episodes/agent_rig.py).

Asserted: a multi-turn, tool-calling episode is one trajectory whose tokens are the chat template's
rendering plus what the engine sampled, with the engine's logprobs (the model's own log-probabilities at
every policy token, and the ones the API returned) and versions; the tool's answer is the only new
suffix (loss-masked); streaming, /v1/completions and /v1/models; OpenAI-style refusals of bad input;
a rewritten history, a crashing or hanging agent and a call past the budget are counted, never trained
or hung on; plain functions and programs as agents."""
from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from conveyor.env.chat import render_prompt
from conveyor.types import Task

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import agent_rig as R  # noqa: E402


@pytest.fixture(scope="module")
def taught():
    return R.build()


@pytest.fixture
def rig(taught):
    made = []

    def start(agent, **kw):
        r = R.Rig(taught[1], taught[0], agent, **kw)
        made.append(r)
        return r
    yield start
    for r in made:
        r.close()


def client(base_url, api_key) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)


def test_openai_client_tool_episode_is_recorded_token_exact(rig, taught):
    tok, model = taught
    seen: list = []

    async def agent(base_url, api_key, task):
        return await R.tool_episode(base_url, api_key, task, seen)
    r = rig(agent)
    (traj,) = r.play([R.TASK])
    # The prompt is the chat template's rendering of the first request; between the turns, the only new
    # tokens are the tool message and the next generation prompt (the history's tokens are reused).
    user, recs, turn1 = R.check_tool_replies(tok, seen, traj)
    whole = R.ids_of(tok, user + [{"role": "assistant", "content": R.CALL}, {"role": "tool", "content": "42"}])
    gap = list(traj.completion_ids[recs[0].end:recs[1].start])
    assert gap == whole[len(traj.prompt_ids) + len(turn1) - 1:]  # the EOS the template does not write back
    between = slice(recs[0].end, recs[1].start)
    assert set(traj.loss_mask[between]) == {0} and set(traj.versions[between]) == {-1}
    # The logprobs are the engine's: the API returned them, and the model's own log-probabilities over the
    # whole sequence equal them at every policy token.
    own = [i for i, m in enumerate(traj.loss_mask) if m]
    api_lps = [t.logprob for resp in seen for t in resp.choices[0].logprobs.content]
    assert [traj.logprobs[i] for i in own] == api_lps
    assert [traj.completion_ids[i] for i in own] == turn1 + list(traj.completion_ids[recs[1].start:recs[1].end])
    got = R.model_logprobs(model, traj, own)
    assert torch.allclose(got, torch.tensor(api_lps), atol=1e-4, rtol=0), (got - torch.tensor(api_lps)).abs().max()
    assert {traj.versions[i] for i in own} == {0}
    assert recs[1].reward == 1.0 and traj.env_return == 1.0 and traj.reward_info == {"calls": 2.0}
    assert r.pool.counts()["agent_calls"] == 2 and r.pool.counts()["episodes"] == 1


def test_streaming_completions_and_models(rig, taught):
    tok, _ = taught
    seen: dict = {}

    async def agent(base_url, api_key, task):
        c = client(base_url, api_key)
        seen["models"] = [m.id for m in (await c.models.list()).data]
        msgs = [{"role": "user", "content": task.prompt}]
        stream = await c.chat.completions.create(model="policy", messages=msgs, tools=[R.CALCULATOR], stream=True,
                                                 stream_options={"include_usage": True})
        calls, finish, usage = [], None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                calls += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
        seen["stream"] = (calls[0].function.name, json.loads(calls[0].function.arguments), finish, usage)
        # /v1/completions continues the same episode by text: the first prompt, then that prompt + its reply.
        prompt = render_prompt(tok, [{"role": "user", "content": "6*7="}], ())
        text = await c.completions.create(model="policy", prompt=prompt, max_tokens=20, logprobs=1)
        seen["text"] = text.choices[0].text
        return None
    r = rig(agent, max_turns=3)
    (traj,) = r.play([R.TASK])
    assert seen["models"] == ["policy"]
    name, args, finish, usage = seen["stream"]
    assert (name, args, finish) == ("calculator", {"expression": "6*7"}, "tool_calls")
    first_prompt = R.ids_of(tok, [{"role": "user", "content": R.TASK.prompt}])
    assert usage.completion_tokens == len(R.CALL) + 1 and usage.prompt_tokens == len(first_prompt)
    # The raw completion's prompt is the first render without the reply: a rewrite of the chat history,
    # counted and not trained (the agent returned None: the reward function would have scored it).
    assert seen["text"] == R.CALL
    assert traj is None and r.pool.counts()["history_rewritten"] == 1 and r.pool.counts()["rewritten_calls"] == 1


def test_completions_episode_continues_by_prefix(rig, taught):
    tok, _ = taught

    async def agent(base_url, api_key, task):
        c = client(base_url, api_key)
        prompt = render_prompt(tok, [{"role": "user", "content": task.prompt}], ())
        first = (await c.completions.create(model="policy", prompt=prompt, max_tokens=24)).choices[0].text
        prompt += first + "\n<|tool|>42\n<|assistant|>"
        second = (await c.completions.create(model="policy", prompt=prompt, max_tokens=24)).choices[0].text
        return float(second == "42")
    r = rig(agent)
    (traj,) = r.play([R.TASK])
    assert traj is not None and traj.turns == 2 and traj.env_return == 1.0
    assert tok.decode(list(traj.completion_ids), skip_special_tokens=False) == \
        R.CALL + "</s>\n<|tool|>42\n<|assistant|>42</s>"


def test_openai_agents_sdk_runs_an_agent_through_the_endpoint(rig):
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    set_tracing_disabled(True)
    calls = []

    @function_tool
    def calculator(expression: str) -> str:
        """Exact arithmetic."""
        calls.append(expression)
        return str(eval(expression))

    async def agent(base_url, api_key, task):
        model = OpenAIChatCompletionsModel(model="policy", openai_client=client(base_url, api_key))
        bot = Agent(name="calc", instructions=R.SYSTEM, tools=[calculator], model=model)
        result = await Runner.run(bot, task.prompt, max_turns=4)
        return float(str(result.final_output).strip() == task.answer)
    r = rig(agent)
    (traj,) = r.play([R.TASK])
    assert calls == ["6*7"]
    assert traj is not None and traj.turns == 2 and traj.env_return == 1.0
    assert traj.turn_records[0].tool_calls == ("calculator",)


def test_bad_input_gets_openai_errors_naming_the_reason(rig):
    import httpx2
    out: dict = {}

    async def agent(base_url, api_key, task):
        h = {"Authorization": f"Bearer {api_key}"}
        async with httpx2.AsyncClient(timeout=30) as http:
            async def post(body, headers=h, path="/chat/completions"):
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                resp = await http.post(base_url + path, content=raw,
                                       headers={**headers, "Content-Type": "application/json"})
                return resp.status_code, resp.json()["error"]
            ok = {"model": "policy", "messages": [{"role": "user", "content": "6*7="}]}
            out["json"] = await post(b"{not json")
            out["model"] = await post({**ok, "model": "gpt-9"})
            out["messages"] = await post({"model": "policy"})
            out["schema"] = await post({**ok, "tools": [{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 12}}}}}]})
            out["n"] = await post({**ok, "n": 2})
            out["nokey"] = await post(ok, headers={})
            out["badkey"] = await post(ok, headers={"Authorization": "Bearer ep-nope"})
            out["route"] = (await http.get(base_url + "/embeddings")).json()["error"]
            out["prompt"] = await post({"model": "policy"}, path="/completions")
            # A well-formed call still works after all of that, and the header names the episode too.
            good = await http.post(base_url + "/chat/completions", json=ok, headers={"X-Conveyor-Episode": api_key})
            out["good"] = good.status_code
        return 0.0
    r = rig(agent)
    r.play([R.TASK])
    for key, (status, code, words) in {
            "json": (400, "invalid_json", "not valid JSON"),
            "model": (404, "model_not_found", "'gpt-9' does not exist"),
            "messages": (400, "missing_messages", "'messages' is missing"),
            "schema": (400, "invalid_tool_schema", "tools[0].function.parameters is not a JSON schema"),
            "n": (400, None, "n=2"), "nokey": (401, "missing_episode_key", "no episode key"),
            "badkey": (401, "invalid_api_key", "unknown episode key"),
            "prompt": (400, "missing_prompt", "'prompt' must be")}.items():
        got_status, err = out[key]
        assert got_status == status and err["code"] == code and words in err["message"], (key, out[key])
        assert set(err) == {"message", "type", "param", "code"}
    assert out["route"]["code"] == "not_found" and out["good"] == 200
    assert r.pool.counts()["bad_requests"] == 8


def test_rewritten_history_is_counted_and_never_trained(rig):
    async def agent(base_url, api_key, task):
        c = client(base_url, api_key)
        msgs = [{"role": "user", "content": task.prompt}]
        await c.chat.completions.create(model="policy", messages=msgs, tools=[R.CALCULATOR])
        # The client "summarises" its history: the model's reply is replaced by other text.
        msgs += [{"role": "assistant", "content": "I will use the calculator."}, {"role": "tool", "content": "42"}]
        await c.chat.completions.create(model="policy", messages=msgs, tools=[R.CALCULATOR])
        return 1.0
    r = rig(agent)
    assert r.play([R.TASK]) == [None]
    counts = r.pool.counts()
    assert counts["history_rewritten"] == 1 and counts["rewritten_calls"] == 1 and counts["episodes_failed"] == 1


def test_failing_hanging_and_over_budget_agents(rig):
    keys: list = []

    async def agent(base_url, api_key, task):
        kind = task.info["kind"]
        if kind == "raises":
            raise RuntimeError("the agent's own bug")
        c = client(base_url, api_key)
        msgs = [{"role": "user", "content": task.prompt}]

        async def ask():
            r = await c.chat.completions.create(model="policy", messages=msgs)
            msgs.extend([r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}])
        if kind == "hangs":  # never closes its episode
            keys.append((base_url, api_key))
        await ask()
        if kind == "hangs":
            await asyncio.sleep(3600)
        if kind == "budget":  # a third call past env.max_turns=2
            from openai import BadRequestError
            await ask()
            try:
                await ask()
            except BadRequestError as e:
                assert e.body["code"] == "episode_budget_exhausted"
                return 0.5
        return "not a reward"
    r = rig(agent, max_turns=2)  # the default 30 s deadline: these episodes end by themselves
    out = r.play([Task(k, "6*7=", "42", {"kind": k}) for k in ("raises", "budget", "bad_return")])
    assert out[0] is None and out[2] is None
    assert out[1].finish_reason == "length" and out[1].turns == 2 and out[1].env_return == 0.5
    counts = r.pool.counts()
    assert counts["crash"] == 1 and counts.get("timeout", 0) == 0 and counts["bad_return"] == 1
    assert counts["budget_exhausted"] == 1 and counts["episodes_failed"] == 2
    # The hung agent on a rig of its own: its short deadline is not a bound on the others' calls.
    r = rig(agent, episode_timeout_s=2.0, max_turns=2)
    t0 = time.perf_counter()
    assert r.play([Task("hangs", "6*7=", "42", {"kind": "hangs"})]) == [None]
    assert time.perf_counter() - t0 < 60  # no-hang bound: the 2 s deadline, not the hung agent's hour
    assert r.pool.counts()["timeout"] == 1 and r.pool.counts()["episodes_failed"] == 1
    base_url, key = keys[0]  # the hung agent's key is refused from its deadline on
    with pytest.raises(Exception) as err:
        OpenAI(base_url=base_url, api_key=key, max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 410 and err.value.body["code"] == "episode_closed"
    r.endpoint.end()  # the run ended: every key is refused
    with pytest.raises(Exception) as err:
        OpenAI(base_url=base_url, api_key=key, max_retries=0).models.list() and \
            OpenAI(base_url=base_url, api_key=key, max_retries=0).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 410 and err.value.body["code"] == "run_ended"


def sync_agent(base_url, api_key, task):
    """A plain function with the synchronous client: run in the pool's threads."""
    c = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)
    r = c.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.prompt}],
                                  tools=[R.CALCULATOR])
    return float(r.choices[0].message.tool_calls[0].function.name == "calculator")


PROGRAM = """
import json, os, sys
from openai import OpenAI
task = json.loads(sys.stdin.read())
c = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
r = c.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=[{"role": "user", "content": task["prompt"]}])
print("some log line")
print(json.dumps({"reward": 0.25, "chars": len(r.choices[0].message.content or "")}))
"""


def test_sync_functions_and_programs_are_agents(rig, tmp_path):
    r = rig(sync_agent)
    (traj,) = r.play([R.TASK])
    assert traj.env_return == 1.0 and traj.turns == 1 and r.pool.counts()["episodes"] == 1
    program = tmp_path / "agent.py"
    program.write_text(PROGRAM)
    r = rig({"command": [sys.executable, str(program)]})
    (traj,) = r.play([R.TASK])
    assert traj.env_return == 0.25 and traj.reward_info == {"chars": float(len(R.CALL))}
    program.write_text("import sys; print('bad input', file=sys.stderr); sys.exit(4)")
    assert r.play([R.TASK]) == [None]
    assert r.pool.counts()["crash"] == 1
