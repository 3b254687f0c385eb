"""Tool-call parsing (hermes, llama3, plain, auto) and checking calls against schemas."""
import pytest

from conveyor.env.api import Tool, ToolCall
from conveyor.env.parsers import (
    ParsedTurn,
    ParseError,
    check_call,
    format_error,
    format_tool_result,
    parse_tool_calls,
)


def _tool(name, properties, required, additional=None):
    schema = {"type": "object", "properties": properties, "required": required}
    if additional is not None:
        schema["additionalProperties"] = additional
    return Tool(name, f"the {name} tool", schema, lambda **kw: "ok")


CALC = _tool("calculator", {"expression": {"type": "string"}}, ["expression"], additional=False)
ADD = _tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}, "note": {"type": "string"}},
            ["a", "b"])
TOOLS = [CALC, ADD]


def _calls(turn: ParsedTurn):
    return [(c.name, dict(c.arguments)) for c in turn.calls]


# ---------------------------------------------------------------- hermes

def test_hermes_several_calls_and_content():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n'
            '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\nDone.')
    turn = parse_tool_calls(text, "hermes", TOOLS)
    assert _calls(turn) == [("calculator", {"expression": "123*456"}), ("add", {"a": 1, "b": 2})]
    assert turn.errors == ()
    assert turn.content == "Let me compute.\nDone."
    assert turn.calls[1].raw == '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def test_hermes_arguments_as_json_string_and_python_dict():
    turn = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 4, \\"b\\": 5}"}</tool_call>',
                            "hermes", TOOLS)
    assert _calls(turn) == [("add", {"a": 4, "b": 5})]
    turn = parse_tool_calls("<tool_call>{'name': 'add', 'arguments': {'a': 1, 'b': True}}</tool_call>",
                            "hermes", TOOLS)
    assert _calls(turn) == [("add", {"a": 1, "b": True})]


def test_hermes_unclosed_call_is_malformed():
    text = 'thinking <tool_call>{"name": "calculator", "arguments": {"expression": "1+'
    turn = parse_tool_calls(text, "hermes", TOOLS)
    assert turn.calls == ()
    assert [e.kind for e in turn.errors] == ["malformed_call"]
    assert turn.errors[0].raw == '<tool_call>{"name": "calculator", "arguments": {"expression": "1+'
    assert turn.content == "thinking"


@pytest.mark.parametrize("body", ['not json', '["calculator"]', '{"arguments": {}}',
                                  '{"name": "add", "arguments": [1, 2]}',
                                  '{"name": "add", "arguments": "not json"}'])
def test_hermes_bad_bodies_are_malformed_and_never_raise(body):
    turn = parse_tool_calls(f"<tool_call>{body}</tool_call>", "hermes", TOOLS)
    assert turn.calls == ()
    assert len(turn.errors) == 1 and turn.errors[0].kind == "malformed_call"
    assert "\n" not in turn.errors[0].message


def test_hermes_good_call_survives_a_bad_one():
    text = '<tool_call>oops</tool_call><tool_call>{"name": "calculator", "arguments": {"expression": "2"}}</tool_call>'
    turn = parse_tool_calls(text, "hermes", TOOLS)
    assert _calls(turn) == [("calculator", {"expression": "2"})]
    assert len(turn.errors) == 1


# ---------------------------------------------------------------- llama3

def test_llama3_python_tag_several_calls_with_semicolons_inside_strings():
    text = ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
            '{"name": "calculator", "arguments": {"expression": "1;2"}}<|eom_id|>')
    turn = parse_tool_calls(text, "llama3", TOOLS)
    assert _calls(turn) == [("add", {"a": 1, "b": 2}), ("calculator", {"expression": "1;2"})]
    assert turn.errors == () and turn.content == ""


def test_llama3_plain_text_and_json_answers_are_content():
    assert parse_tool_calls("The answer is 5.", "llama3", TOOLS) == ParsedTurn((), (), "The answer is 5.")
    assert parse_tool_calls('{"answer": 5}', "llama3", TOOLS) == ParsedTurn((), (), '{"answer": 5}')


def test_llama3_truncated_call_is_malformed():
    turn = parse_tool_calls('{"name": "add", "parameters": {"a": 1', "llama3", TOOLS)
    assert turn.calls == () and [e.kind for e in turn.errors] == ["malformed_call"]


# ---------------------------------------------------------------- plain

def test_plain_single_positional_maps_to_first_required_parameter():
    turn = parse_tool_calls("I need to multiply.\ncalculator(123*456)\n", "plain", TOOLS)
    assert _calls(turn) == [("calculator", {"expression": "123*456"})]
    assert turn.content == "I need to multiply."


@pytest.mark.parametrize("line,expected", [
    ('calculator("7 * 8")', ("calculator", {"expression": "7 * 8"})),
    ("`calculator((1+2)*3)`", ("calculator", {"expression": "(1+2)*3"})),
    ('calculator(expression="2+3")', ("calculator", {"expression": "2+3"})),
    ("calculator(expression=2 + 3)", ("calculator", {"expression": "2 + 3"})),
    ("add(2, 3)", ("add", {"a": 2, "b": 3})),
    ("add(2, b=3, note='hi')", ("add", {"a": 2, "b": 3, "note": "hi"})),
    ("add()", ("add", {})),
])
def test_plain_argument_shapes(line, expected):
    turn = parse_tool_calls(line, "plain", TOOLS)
    assert _calls(turn) == [expected]


def test_plain_ignores_unknown_names_and_prose():
    text = "f(x) = 3x + 1\nprint(5)\nthe calculator(s) are great"
    assert parse_tool_calls(text, "plain", TOOLS) == ParsedTurn((), (), text)


def test_plain_too_many_positionals_is_malformed():
    turn = parse_tool_calls("add(1, 2, 'x', 4)", "plain", TOOLS)
    assert turn.calls == () and [e.kind for e in turn.errors] == ["malformed_call"]


# ---------------------------------------------------------------- auto

def test_auto_prefers_hermes_then_llama3_then_plain():
    both = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>\ncalculator(5)'
    assert _calls(parse_tool_calls(both, "auto", TOOLS)) == [("calculator", {"expression": "1"})]
    llama = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert _calls(parse_tool_calls(llama, "auto", TOOLS)) == [("add", {"a": 1, "b": 2})]
    assert _calls(parse_tool_calls("calculator(5)", "auto", TOOLS)) == [("calculator", {"expression": "5"})]
    assert parse_tool_calls("no call here", "auto", TOOLS) == ParsedTurn((), (), "no call here")
    # A malformed hermes call counts as found: plain does not get a second guess.
    turn = parse_tool_calls("<tool_call>{\ncalculator(5)", "auto", TOOLS)
    assert turn.calls == () and len(turn.errors) == 1


NASTY = ["", "<tool_call>", "</tool_call>", "<|python_tag|>", "<|python_tag|>{", "{" * 5000,
         "calculator(" * 50 + ")" * 50, "\x00\uffff", "add(**x)",
         '<|python_tag|>{"name": "a", "parameters": ' + "[" * 100000,  # json recursion limit
         "<tool_call>" + "[" * 100000 + "]" * 100000 + "</tool_call>"]


@pytest.mark.parametrize("text", NASTY, ids=lambda t: repr(t[:20]))
@pytest.mark.parametrize("fmt", ["hermes", "llama3", "plain", "auto"])
def test_never_raises_on_model_output(text, fmt):
    turn = parse_tool_calls(text, fmt, TOOLS)
    assert isinstance(turn, ParsedTurn)
    assert all(e.kind == "malformed_call" for e in turn.errors)


def test_unknown_format_and_error_kind_are_refused():
    with pytest.raises(ValueError, match="not one of"):
        parse_tool_calls("x", "mistral", TOOLS)
    with pytest.raises(ValueError, match="not one of"):
        ParseError("bad", "m")


# ---------------------------------------------------------------- check_call

def test_check_call_accepts_good_calls():
    assert check_call(ToolCall("calculator", {"expression": "1+1"}), TOOLS) is None
    assert check_call(ToolCall("add", {"a": 1, "b": 2.0, "note": "x", "extra": 1}), TOOLS) is None


def test_check_call_unknown_tool_lists_known_tools():
    err = check_call(ToolCall("weather", {}), TOOLS)
    assert err.kind == "unknown_tool"
    assert str(err) == "unknown tool 'weather'; known tools: add, calculator"


@pytest.mark.parametrize("args,message", [
    ({}, "calculator: missing required argument 'expression'; expected calculator(expression: string)"),
    ({"expression": 5}, ("calculator: 'expression' must be a string, got an integer (5); "
                         "expected calculator(expression: string)")),
    ({"expression": "1", "x": 2}, "calculator: unknown argument 'x'; expected calculator(expression: string)"),
])
def test_check_call_bad_arguments_messages(args, message):
    err = check_call(ToolCall("calculator", args), TOOLS)
    assert err.kind == "bad_arguments" and str(err) == message


@pytest.mark.parametrize("schema,value,ok", [
    ({"type": "integer"}, 3, True), ({"type": "integer"}, 3.0, True), ({"type": "integer"}, 3.5, False),
    ({"type": "integer"}, True, False), ({"type": "number"}, 2.5, True), ({"type": "number"}, "2", False),
    ({"type": "boolean"}, False, True), ({"type": "boolean"}, 0, False),
    ({"type": "array", "items": {"type": "string"}}, ["a", "b"], True),
    ({"type": "array", "items": {"type": "string"}}, ["a", 1], False),
    ({"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}, {"k": "v"}, True),
    ({"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}, {}, False),
    ({"type": ["string", "null"]}, None, True), ({"type": "string", "enum": ["a", "b"]}, "c", False),
])
def test_check_call_schema_subset(schema, value, ok):
    tool = _tool("t", {"v": schema}, ["v"])
    err = check_call(ToolCall("t", {"v": value}), [tool])
    assert (err is None) == ok
    if not ok:
        assert err.kind == "bad_arguments" and "'v'" in str(err)


def test_observation_texts():
    assert format_tool_result("calculator", "56088\n") == "calculator: 56088"
    assert format_error("unknown tool 'x'") == "error: unknown tool 'x'"


@pytest.mark.parametrize("name, parameters, problem", [
    ("add", {"type": "object", "properties": {"a": {"type": "int"}}},
     "tool add: parameters.properties.a.type 'int' is not a JSON type"),
    ("add", {"type": "object", "properties": {"a": {"type": "number"}}, "required": ["b"]},
     "tool add: parameters.required names ['b'] that are not in its properties"),
    ("add", {"properties": {}}, "tool add: parameters must be a JSON schema of type object"),
    ("add two", {"type": "object"}, "tool name 'add two' must be 1-64 letters"),
    ("add", {"type": "object", "properties": {"a": {"type": "array", "items": "number"}}},
     "tool add: parameters.properties.a.items must be a schema (a mapping), got str"),
])
def test_a_tool_declared_wrong_is_named(name, parameters, problem):
    from conveyor.env.parsers import tool_problem
    assert tool_problem(Tool(name, "d", parameters, lambda **kw: "")).startswith(problem)


def test_the_builtin_tools_are_declared_right(tmp_path):
    from conveyor.env.parsers import tool_problem
    from conveyor.env.tools.calculator import calculator_tool
    from conveyor.env.tools.search import search_tool
    assert [tool_problem(t) for t in (*TOOLS, calculator_tool(), search_tool(tmp_path))] == [None] * (len(TOOLS) + 2)
