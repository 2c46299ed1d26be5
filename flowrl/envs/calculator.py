"""The example tool: a calculator over arithmetic expressions, evaluated safely.

The expression is parsed with :mod:`ast` and only numbers, ``+ - * / // % **``, unary ``+ -`` and
parentheses are evaluated: names, calls, attributes, subscripts, comprehensions and every other
node are refused, so nothing of Python beyond arithmetic is reachable (this is not ``eval``).
Sizes are bounded so a short expression cannot take the worker's memory or time: at most
``MAX_CHARS`` characters, exponents of at most ``MAX_EXPONENT``, intermediate values of at most
``MAX_MAGNITUDE``.
"""
from __future__ import annotations

import ast
import math
import operator
from typing import Callable

MAX_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the message says why)."""


def _check(x: float) -> float:
    if isinstance(x, complex) or not math.isfinite(x) or abs(x) > MAX_MAGNITUDE:
        raise CalculatorError(f"result out of range (|x| <= {MAX_MAGNITUDE:g})")
    return x


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    # int or float, not bool (True + True is not arithmetic), complex, str, bytes, ...
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return _check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right:g} too large (at most {MAX_EXPONENT})")
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError(f"result out of range (|x| <= {MAX_MAGNITUDE:g})") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise CalculatorError(f"unsupported syntax: {type(node).__name__} (numbers, + - * / // % ** "
                          "and parentheses only)")


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression.

    Raises:
        CalculatorError: not a string, longer than MAX_CHARS, not arithmetic, division by zero,
            a value out of range.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    return _eval(tree)


def format_number(x: float) -> str:
    """``12`` for whole numbers (also 12.0), else up to 10 significant digits (``0.3333333333``)."""
    if isinstance(x, int) or float(x).is_integer():
        return str(int(x))
    return f"{x:.10g}"


# declared, so offering the built-in tool reads no docstring (transformers' get_json_schema,
# which imports torch, is only for tools given without a schema); test_multi_turn checks that it
# equals what get_json_schema reads from calculator's signature and docstring
CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression and return its value.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {
                "type": "string",
                "description": 'numbers with + - * / // % ** and parentheses, e.g. "(48 / 2) * 3".'}},
            "required": ["expression"],
        },
    },
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(48 / 2) * 3".
    """
    return format_number(evaluate(expression))
