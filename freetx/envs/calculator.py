"""The calculator task: products of two numbers that a small model cannot work out in
its head, with a `calculate` tool that can (docs/environments.md). A reply that calls
the tool gets the result; a reply that calls none ends the episode, and the rewards
(ExactMatch on the row's `answer`) score it. Its demonstrations call the tool in
`tool_share` of the conversations and answer straight away in the rest, so that the
SFT leaves a model that sometimes calls it: RL makes it call it."""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable, Mapping
from typing import Any

from freetx.envs.language import Message, Turn

_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def _value(node: ast.AST) -> float:
    """An arithmetic expression's value (numbers, + - * /, parentheses, unary minus)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError("only numbers, + - * / and parentheses are allowed")


class Calculator:
    """Multiply two numbers from `low` to `high` with the `calculate` tool (module
    docstring). The row's fields: `answer` (the product, as text)."""

    name = "calculator"

    def __init__(self, low: int = 11, high: int = 99, tool_share: float = 0.5) -> None:
        self.low, self.high, self.tool_share = low, high, tool_share

    def tools(self) -> list[Callable[..., Any]]:
        return [self.calculate]

    def calculate(self, expression: str) -> str:
        """Work out an arithmetic expression.

        Args:
            expression: numbers with + - * / and parentheses, e.g. 12*(3+4)
        """
        value = _value(ast.parse(expression.strip(), mode="eval").body)
        return str(int(value)) if float(value).is_integer() else f"{value:.6g}"

    def reset(self, messages: list[Message], row: Mapping[str, Any]) -> list[Message]:
        return messages

    def step(self, messages: list[Message], row: Mapping[str, Any]) -> Turn:
        return Turn(done=True)  # a reply without a call is the answer

    def _draws(self, count: int, seed: int) -> list[tuple[int, int]]:
        rng = random.Random(seed)
        return [
            (rng.randint(self.low, self.high), rng.randint(self.low, self.high))
            for _ in range(count)
        ]

    def rows(self, count: int, seed: int) -> list[dict[str, Any]]:
        return [
            {"prompt": f"What is {a}*{b}?", "answer": str(a * b), "task": self.name}
            for a, b in self._draws(count, seed)
        ]

    def demonstrations(self, count: int, seed: int) -> list[list[Message]]:
        rng = random.Random(seed + 1)
        talks = []
        for a, b in self._draws(count, seed):
            question = {"role": "user", "content": f"What is {a}*{b}?"}
            answer = {"role": "assistant", "content": str(a * b)}
            if rng.random() < self.tool_share:
                call = {"name": "calculate", "arguments": {"expression": f"{a}*{b}"}}
                talks.append(
                    [
                        question,
                        {
                            "role": "assistant",
                            "content": "",
                            "tool_calls": [{"type": "function", "function": call}],
                        },
                        {"role": "tool", "name": "calculate", "content": str(a * b)},
                        answer,
                    ]
                )
            else:
                talks.append([question, answer])
        return talks
