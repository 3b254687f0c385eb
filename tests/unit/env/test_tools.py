"""The builtin tools (calculator, search), how tools reach the prompt (chat rendering), and how the
tool environment checks a final answer."""
import json

import pytest

from conveyor.data.tiny import build_tokenizer
from conveyor.env.api import ToolCall, ToolError
from conveyor.env.chat import render_prompt, tools_system_prompt
from conveyor.env.parsers import check_call, parse_tool_calls
from conveyor.env.tool_env import ToolEnv
from conveyor.env.tools.calculator import calculator_tool
from conveyor.env.tools.search import BM25, search_tool, tokenize
from conveyor.types import Task

# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize("expression,result", [
    ("123*456", "56088"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("-(3+4)*2", "-14"), ("+5", "5"),
    ("7/2", "3.5"), ("10/4*2", "5"), ("(1/3)*3", "1"), ("1/3", "0.3333333333333333"),
    ("0.1+0.2", "0.3"), ("17//5", "3"), ("-7//2", "-4"), ("17%5", "2"), ("2**10", "1024"),
    ("2**-2", "0.25"), ("2**0.5", "1.4142135623730951"), ("2**100", str(2 ** 100)),
    ("12345678901234567890*98765432109876543210", str(12345678901234567890 * 98765432109876543210)),
    (" 6*7 = ", "42"),
])
def test_calculator_results(expression, result):
    assert calculator_tool().fn(expression=expression) == result


@pytest.mark.parametrize("expression,fragment", [
    ("1/0", "division by zero"), ("5%0", "division by zero"), ("0**-1", "division by zero"),
    ("x+1", "name 'x' is not allowed"), ("abs(-3)", "function call is not allowed"),
    ("__import__('os')", "function call is not allowed"), ("2^3", "write ** for a power"),
    ("10**1000", "over 300 digits"), ("9**9**9", "exponent 387420489 is over 1000"),
    ("(-8)**0.5", "not a real number"), ("'a'+'b'", "'a' is not a number"), ("True+1", "not a number"),
    ("2+", "cannot parse"), ("", "expression is empty"), ("1" * 600, "over 500"),
    ("[1][0]", "not allowed"), ("1 if 1 else 2", "not allowed"),
])
def test_calculator_refuses_with_bad_arguments(expression, fragment):
    with pytest.raises(ToolError, match="^calculator: ") as info:
        calculator_tool().fn(expression=expression)
    assert info.value.kind == "bad_arguments"
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_calculator_schema_and_plain_call_round_trip():
    tool = calculator_tool()
    assert tool.name == "calculator"
    assert tool.parameters["required"] == ["expression"]
    assert list(tool.parameters["properties"]) == ["expression"]
    call = parse_tool_calls("calculator(123*456)", "plain", [tool]).calls[0]
    assert check_call(call, [tool]) is None
    assert tool.fn(**call.arguments) == "56088"
    assert check_call(ToolCall("calculator", {"expression": 5}), [tool]).kind == "bad_arguments"


# ---------------------------------------------------------------- search


@pytest.fixture()
def docs(tmp_path):
    (tmp_path / "paris.md").write_text(
        "# Paris\n\nParis is the capital and largest city of France. "
        + "It is known for its museums and cafes. " * 30
        + "The Eiffel Tower was completed in 1889 for the World Fair.\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "berlin.txt").write_text("Berlin is the capital of Germany. The wall fell in 1989.")
    (tmp_path / "rome.txt").write_text("Rome is the capital of Italy. Rome has the Colosseum.")
    (tmp_path / "tower.rst").write_text("Eiffel tower eiffel tower eiffel tower")  # not indexed
    return tmp_path


def test_bm25_ranks_rare_terms_and_normalises_length():
    index = BM25([tokenize("a cat sat"), tokenize("a dog sat"), tokenize("a cat " + "filler " * 50)])
    scores = index.scores(["cat"])
    assert scores[1] == 0.0
    assert scores[0] > scores[2] > 0.0  # same tf, the shorter document wins
    assert index.idf["cat"] > index.idf["a"]


def test_search_puts_the_right_document_first(docs):
    tool = search_tool(docs)
    out = tool.fn(query="When was the Eiffel Tower completed?")
    lines = out.splitlines()
    assert lines[0].startswith("[1] paris.md: ...")
    assert "The Eiffel Tower was completed in 1889 for the World Fair." in lines[0]
    assert "tower.rst" not in out
    out = tool.fn(query="capital of Germany")
    assert out.splitlines()[0] == "[1] sub/berlin.txt: Berlin is the capital of Germany. The wall fell in 1989."
    assert [line.split(":")[0] for line in out.splitlines()] == ["[1] sub/berlin.txt", "[2] rome.txt", "[3] paris.md"]


def test_search_caps_results_and_characters(docs):
    out = search_tool(docs, k=2, max_chars=100).fn(query="capital")
    lines = out.splitlines()
    assert len(lines) == 2 and len(out) <= 100
    assert lines[0].startswith("[1] rome.txt: Rome is the capital") and lines[0].endswith("...")
    assert len(search_tool(docs, k=3, max_chars=600).fn(query="capital")) <= 600


def test_search_no_match_empty_folder_and_bad_query(docs, tmp_path_factory):
    tool = search_tool(docs)
    assert tool.fn(query="zebra") == "no results for 'zebra'"
    empty = tmp_path_factory.mktemp("empty")
    assert search_tool(empty).fn(query="x").startswith("no documents to search")
    with pytest.raises(ToolError) as info:
        tool.fn(query="  ?! ")
    assert info.value.kind == "bad_arguments"


def test_search_missing_folder_is_a_one_line_value_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope") as info:
        search_tool(missing)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- chat rendering

QWEN_LIKE = (
    "{%- if tools %}<|system|><tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
USER = [{"role": "user", "content": "What is 123*456?"}]


def test_tiny_template_ignores_tools_so_the_system_message_carries_them():
    tok = build_tokenizer()
    tool = calculator_tool()
    prompt = render_prompt(tok, USER, [tool])
    assert prompt == f"<|system|>{tools_system_prompt([tool])}\n<|user|>What is 123*456?\n<|assistant|>"
    assert json.dumps(tool.schema()) in prompt and "<tool_call>" in prompt
    # An existing system message is kept, the tools follow it.
    messages = [{"role": "system", "content": "Be brief."}] + USER
    prompt = render_prompt(tok, messages, [tool])
    assert prompt.startswith("<|system|>Be brief.\n\n# Tools\n")
    assert prompt.count("<|system|>") == 1
    assert messages[0]["content"] == "Be brief."  # the caller's messages are not modified
    assert render_prompt(tok, USER, []) == "<|user|>What is 123*456?\n<|assistant|>"


def test_template_that_renders_tools_is_used_as_is(tmp_path):
    tok = build_tokenizer()
    tok.chat_template = QWEN_LIKE
    tools = [calculator_tool(), search_tool(tmp_path)]
    prompt = render_prompt(tok, USER, tools)
    for t in tools:
        assert json.dumps(t.schema(), ensure_ascii=False) in prompt
    assert prompt.startswith("<|system|><tools>") and prompt.endswith("<|user|>What is 123*456?\n<|assistant|>")
    assert "# Tools" not in prompt  # no fallback description on top of the template's own


def test_no_chat_template_joins_plain_text():
    tok = build_tokenizer()
    tok.chat_template = None
    tool = calculator_tool()
    prompt = render_prompt(tok, USER, [tool])
    assert prompt == f"system: {tools_system_prompt([tool])}\nuser: What is 123*456?\nassistant:"
    assert render_prompt(tok, USER, []) == "user: What is 123*456?\nassistant:"


def test_template_that_fails_on_tools_falls_back_to_the_system_message():
    tok = build_tokenizer()
    tok.chat_template = ("{% if tools %}{{ raise_exception('tools are not supported') }}{% endif %}"
                         "{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}")
    prompt = render_prompt(tok, USER, [calculator_tool()])
    assert prompt == f"system> {tools_system_prompt([calculator_tool()])}\nuser> What is 123*456?\n"


def test_model_text_that_python_warns_about_stays_off_the_console():
    # "2or 3" parses, and Python prints a SyntaxWarning for it ("invalid decimal literal") on
    # stderr: the tool answers its error, the console stays clean (a fresh interpreter: pytest
    # records warnings).
    import subprocess
    import sys
    code = ("from conveyor.env.api import ToolError\n"
            "from conveyor.env.parsers import parse_tool_calls\n"
            "from conveyor.env.tools.calculator import calculate, calculator_tool\n"
            "try:\n    calculate('2or 3')\nexcept ToolError as e:\n    print(e)\n"
            "parse_tool_calls('calculator(expression=3if 1 else 2)', 'plain', [calculator_tool()])\n"
            "parse_tool_calls('<tool_call>calculator(expression=4is 4)</tool_call>', 'auto', [calculator_tool()])\n")
    out = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "calculator:" in out.stdout, out.stderr
    assert out.stderr == ""


# ---------------------------------------------------------------- the tool environment's answer


@pytest.mark.parametrize("answer,action,reward", [
    ("exact", " 56088 ", 1.0), ("exact", "56,088", 0.0),
    ("math", "The product is 56,088.", 1.0), ("math", "\\boxed{56088}", 1.0), ("math", "56087", 0.0),
])
def test_tool_env_checks_the_final_answer_over_its_text(answer, action, reward):
    env = ToolEnv(tools=(), answer=answer)
    env.reset(Task(id="t", prompt="123*456=", answer="56088"))
    result = env.step(action)
    assert (result.reward, result.done, result.info) == (reward, True, {"correct": reward == 1.0})
