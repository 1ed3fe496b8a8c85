"""The calculator tool and its environment: arithmetic a student may call for, never `eval`ed.

    calculate("12*(3+4) - 5/2")             # "81.5"
    calculate("2**10")                       # ToolError: ** is not allowed ...
    env = CalculatorEnvironment(task)       # tools [CALCULATOR]; graded by task.check(final text, answer)

`calculate` reads + - * / ( ), unary minus and plus, integers and decimals: the text is checked character by
character (digits, spaces, the operators, parentheses and the decimal point only: no names, no exponents,
no underscores), then parsed by Python's `ast` into an expression whose every node must be a number, a
binary + - * / or a unary sign; anything else is refused. The arithmetic is exact (fractions); the
expression's length, each number's digits and every intermediate result's size are bounded, so no input
takes long (there is no power, and a product of two bounded numbers is bounded). The result is an integer
when exact, else a decimal with up to `DECIMALS` places.
"""

from __future__ import annotations

import ast
from decimal import ROUND_HALF_EVEN, Context, Decimal
from fractions import Fraction

from opdkit.tasks.base import Task
from opdkit.tasks.environment import ToolEnvironment, ToolError

__all__ = ["CALCULATOR", "CalculatorEnvironment", "ToolError", "calculate"]

MAX_CHARS = 200  # longest expression read
MAX_DIGITS = 30  # digits of a number written in it
MAX_RESULT_DIGITS = 60  # digits of any intermediate result (numerator and denominator)
DECIMALS = 10  # places of a result that is not an integer
ALLOWED = set("0123456789+-*/(). ")

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses; returns the result.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "the expression, e.g. 123*45 + 6"}
            },
            "required": ["expression"],
        },
    },
}

_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_LIMIT = 10**MAX_RESULT_DIGITS


def calculate(expression: str) -> str:
    """The value of an arithmetic `expression` (+ - * / ( ), integers and decimals) as text; `ToolError`
    with the message the model sees for anything else, too long, or too large."""
    if not isinstance(expression, str):
        raise ToolError("the expression must be a string")
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_CHARS:
        raise ToolError(f"expression too long ({len(text)} characters; at most {MAX_CHARS})")
    if "**" in text:
        raise ToolError("** is not allowed: only + - * / and parentheses")
    bad = sorted(set(text) - ALLOWED)
    if bad:
        raise ToolError(f"character {bad[0]!r} not allowed: only digits, + - * / ( ) and .")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError("not an arithmetic expression") from None
    return _format(_value(tree.body, text))


def _value(node: ast.AST, text: str) -> Fraction:
    if isinstance(node, ast.Constant):
        return _number(node, text)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _value(node.operand, text)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _value(node.left, text), _value(node.right, text)
        if isinstance(node.op, ast.Add):
            out = a + b
        elif isinstance(node.op, ast.Sub):
            out = a - b
        elif isinstance(node.op, ast.Mult):
            out = a * b
        else:
            if b == 0:
                raise ToolError("division by zero")
            out = a / b
        if abs(out.numerator) >= _LIMIT or out.denominator >= _LIMIT:
            raise ToolError(f"result too large (more than {MAX_RESULT_DIGITS} digits)")
        return out
    if isinstance(node, ast.BinOp):
        raise ToolError(f"operator {ast.get_source_segment(text, node) or ''!r} not allowed: only + - * /")
    raise ToolError("only numbers, + - * / and parentheses are allowed")


def _number(node: ast.Constant, text: str) -> Fraction:
    if type(node.value) not in (int, float):
        raise ToolError("only numbers are allowed")
    written = ast.get_source_segment(text, node) or ""
    if sum(c.isdigit() for c in written) > MAX_DIGITS:
        raise ToolError(f"number too long (at most {MAX_DIGITS} digits)")
    return Fraction(written)  # exactly as written: 0.1 is 1/10, not the nearest float


def _format(v: Fraction) -> str:
    if v.denominator == 1:
        return str(v.numerator)
    ctx = Context(prec=MAX_RESULT_DIGITS + DECIMALS + 5, rounding=ROUND_HALF_EVEN)
    d = ctx.divide(Decimal(v.numerator), Decimal(v.denominator))
    d = d.quantize(Decimal(1).scaleb(-DECIMALS), context=ctx)
    s = format(d, "f")
    s = s.rstrip("0").rstrip(".") if "." in s else s
    return "0" if s in ("-0", "") else s


class CalculatorEnvironment(ToolEnvironment):
    """The calculator as the one tool (`CALCULATOR`); an episode ends at a turn without a call, its text the
    final answer, graded by `task.check(final text, answer)`."""

    def __init__(self, task: Task):
        super().__init__({"calculator": (CALCULATOR, calculate)}, task.check)
        self.task = task
