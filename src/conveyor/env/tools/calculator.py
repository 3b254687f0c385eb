"""A calculator tool: safe arithmetic on one expression string.

Contract: ``calculator_tool() -> Tool`` named ``calculator`` with one required string
argument ``expression``. The expression is parsed by ``ast`` and walked, never evaluated:
numbers, ``+ - * / // % **``, parentheses, unary ``-`` / ``+``. Arithmetic is exact on
rationals (``fractions.Fraction``; a decimal literal is the decimal it reads, so
``0.1+0.2`` is ``0.3``), floats appear only from a fractional power. The result text is
an integer when the value is one (``123*456`` -> ``56088``, ``10/4*2`` -> ``5``), else the
shortest float repr (``7/2`` -> ``3.5``). Everything else (names, calls, ``^``, division
by zero, an exponent beyond ``MAX_EXPONENT``, a result beyond ``10**MAX_DIGITS``, a
complex result) raises ``ToolError`` of kind ``bad_arguments`` with a one-line message.

It knows nothing of parsing tool calls or of the pool: a pure function behind a ``Tool``.
"""
from __future__ import annotations

import ast
import math
import operator
import warnings
from fractions import Fraction

from conveyor.env.api import Tool, ToolError

# Model text parsed as Python: a literal like 2x is a SyntaxError (answered as such), and
# Python also warns about it on stderr, which would reach the console once per form.
warnings.filterwarnings("ignore", category=SyntaxWarning, module="<calculator>")

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_DIGITS = 300          # |result| < 10**300, which also keeps floats finite
_MAX_DENOMINATOR_BITS = 1024  # beyond this a rational becomes a float (its digits are noise)

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_SYMBOLS = {ast.BitXor: "^ (write ** for a power)", ast.BitAnd: "&", ast.BitOr: "|",
            ast.LShift: "<<", ast.RShift: ">>", ast.MatMult: "@"}

Number = Fraction | float


def calculator_tool() -> Tool:
    """The ``calculator`` tool (see the module docstring)."""
    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression exactly: numbers, + - * / // % **, "
                    "parentheses. Example: 123*456",
        parameters={"type": "object",
                    "properties": {"expression": {"type": "string",
                                                  "description": "the expression, e.g. (2+3)*4"}},
                    "required": ["expression"], "additionalProperties": False},
        fn=calculate,
    )


def calculate(expression: str) -> str:
    """The value of ``expression`` as text; ``ToolError`` (bad_arguments) for anything else."""
    if not isinstance(expression, str):
        raise ToolError(f"calculator: expression must be a string, got {type(expression).__name__}",
                        "bad_arguments")
    text = expression.strip().rstrip("=").strip()
    if not text:
        raise ToolError("calculator: expression is empty; pass e.g. 2+3", "bad_arguments")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"calculator: expression is {len(text)} characters, over "
                        f"{MAX_EXPRESSION_CHARS}; split it", "bad_arguments")
    try:
        tree = ast.parse(text, filename="<calculator>", mode="eval")
    except (SyntaxError, ValueError):
        raise ToolError(f"calculator: cannot parse {text!r}; use numbers, + - * / // % ** "
                        "and parentheses", "bad_arguments") from None
    except RecursionError:
        raise ToolError("calculator: expression is nested too deeply", "bad_arguments") from None
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        raise ToolError(f"calculator: division by zero in {text!r}", "bad_arguments") from None
    except (OverflowError, RecursionError):
        raise ToolError(f"calculator: {text!r} is too large to compute", "bad_arguments") from None
    return _render(value)


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ToolError(f"calculator: {value!r} is not a number", "bad_arguments")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("calculator: the number is too large", "bad_arguments")
        # A decimal literal means the decimal it reads (0.1 is 1/10), not the nearest binary float.
        return _checked(Fraction(repr(value)) if isinstance(value, float) else Fraction(value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        op = _BINOPS.get(type(node.op))
        if op is None:
            symbol = _SYMBOLS.get(type(node.op), type(node.op).__name__)
            raise ToolError(f"calculator: operator {symbol} is not supported", "bad_arguments")
        return _checked(op(left, right))
    what = type(node).__name__
    if isinstance(node, ast.Name):
        what = f"name {node.id!r}"
    elif isinstance(node, ast.Call):
        what = "function call"
    raise ToolError(f"calculator: {what} is not allowed; use numbers, + - * / // % ** and "
                    "parentheses", "bad_arguments")


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"calculator: exponent {_render(exponent)} is over {MAX_EXPONENT}",
                        "bad_arguments")
    if base == 0 and exponent < 0:
        raise ZeroDivisionError
    # Estimate the size first so 10**1000 is refused without being computed.
    if base != 0 and float(exponent) * _log10(abs(base)) > MAX_DIGITS:
        raise ToolError(f"calculator: the result has over {MAX_DIGITS} digits", "bad_arguments")
    if isinstance(exponent, Fraction) and exponent.denominator == 1:
        return base ** int(exponent)  # exact
    result = float(base) ** float(exponent)
    if isinstance(result, complex):
        raise ToolError("calculator: the result is not a real number (a fractional power of "
                        "a negative number)", "bad_arguments")
    return result


def _log10(x: Number) -> float:
    if isinstance(x, Fraction):  # math.log10 takes big integers, not big fractions
        return math.log10(x.numerator) - math.log10(x.denominator)
    return math.log10(x)


def _checked(value: Number | int) -> Number:
    if isinstance(value, int):  # Fraction // Fraction is an int
        value = Fraction(value)
    if isinstance(value, complex):
        raise ToolError("calculator: the result is not a real number", "bad_arguments")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("calculator: the result is too large", "bad_arguments")
        return value
    if abs(value) >= 10 ** MAX_DIGITS:
        raise ToolError(f"calculator: the result has over {MAX_DIGITS} digits", "bad_arguments")
    if value.denominator.bit_length() > _MAX_DENOMINATOR_BITS:
        return float(value)
    return value


def _render(value: Number) -> str:
    if isinstance(value, Fraction):
        if value.denominator == 1:
            return str(value.numerator)
        value = float(value)
    if value.is_integer() and abs(value) < 2 ** 53:
        return str(int(value))
    return repr(value)
