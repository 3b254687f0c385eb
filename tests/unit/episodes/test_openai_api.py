"""OpenAI's request and response shapes: messages, tools and their schemas normalised or refused naming the
field; replies, stream chunks and errors in OpenAI's form."""
import json

import pytest

from conveyor.episodes import openai_api as api

OK = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}


def refused(fn, body):
    with pytest.raises(api.ApiError) as e:
        fn(body)
    return e.value


def test_messages_are_normalised_for_the_chat_template():
    req = api.parse_chat({**OK, "messages": [
        {"role": "developer", "content": "be exact"},
        {"role": "user", "content": [{"type": "text", "text": "6*"}, {"type": "text", "text": "7="}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "6*7"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}], "tools": [TOOL], "stop": "\n",
        "max_completion_tokens": 9, "temperature": 0.1, "stream": True, "stream_options": {"include_usage": True}})
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool"]
    assert req.messages[1]["content"] == "6*7=" and req.messages[2]["content"] == ""
    assert req.messages[2]["tool_calls"][0]["function"] == {"name": "calc", "arguments": {"expression": "6*7"}}
    assert req.tools[0].name == "calc" and req.stop == ("\n",) and req.max_tokens == 9
    assert req.stream and req.include_usage


@pytest.mark.parametrize("body, param, words", [
    ({"messages": []}, "model", "'model' is missing"),
    ({**OK, "messages": []}, "messages", "missing or empty"),
    ({**OK, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'robot'"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "text part"),
    ({**OK, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]", "letters, digits"),
    ({**OK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters", "object schema"),
    ({**OK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": "x"}}}]},
     "tools[0].function.parameters", "is not a JSON schema"),
    ({**OK, "tool_choice": "required"}, "tool_choice", "not supported"),
    ({**OK, "max_tokens": 0}, "max_tokens", "positive integer"),
    ({**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
])
def test_bad_chat_requests_name_the_field(body, param, words):
    err = refused(api.parse_chat, body)
    assert err.status == 400 and err.param == param and words in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_text_requests_and_bad_json():
    assert api.parse_text({"model": "m", "prompt": ["one"]}).prompt == "one"
    assert api.parse_text({"model": "m", "prompt": [1, 2, 3]}).prompt == (1, 2, 3)
    assert refused(api.parse_text, {"model": "m", "prompt": ["a", "b"]}).param == "prompt"
    assert refused(api.parse_json, b"{").code == "invalid_json"
    assert refused(api.parse_json, b"[1]").code == "invalid_json"


def test_replies_and_chunks_have_openai_shapes():
    reply = api.Reply(None, (api.Call("calc", {"expression": "6*7"}, id="call_1"),), "tool_calls", 5,
                      (("c", -0.25), ("</s>", -0.5)))
    body = api.chat_completion("chatcmpl-1", "policy", reply, logprobs=True)
    msg = body["choices"][0]["message"]
    assert msg["tool_calls"][0] == {"id": "call_1", "type": "function",
                                    "function": {"name": "calc", "arguments": json.dumps({"expression": "6*7"})}}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]] == [-0.25, -0.5]
    chunks = api.chat_chunks("chatcmpl-1", "policy", reply, logprobs=False, include_usage=True)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[1]["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert chunks[2]["choices"][0]["finish_reason"] == "tool_calls" and chunks[3]["usage"]["total_tokens"] == 7
    text = api.text_completion("cmpl-1", "policy", api.Reply("42", (), "stop", 3, (("4", -1.0), ("2", -2.0))), True)
    assert text["choices"][0]["logprobs"] == {"tokens": ["4", "2"], "token_logprobs": [-1.0, -2.0],
                                              "top_logprobs": None, "text_offset": [0, 1]}
