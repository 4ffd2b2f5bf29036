"""Tools a model calls during an episode (docs/environments.md): their JSON schemas, the
calls parsed from a reply, and the results as the model reads them.

A tool is a plain Python function (or a bound method), described to the model the way
transformers' `get_json_schema` describes it: its name, the docstring's first paragraph,
each argument's type from its annotation and its description from the docstring's
`Args:` section; arguments without a default are required. The schemas go to the chat
template (`tools=`), which writes them into the prompt as the model was trained to read
them.

A reply's calls are parsed in the format of the template's family (`tool_format`):

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
  (Qwen 2.5 / 3, Hermes, SmolLM3, freetx's byte template `turns`);
- `llama3`: the reply is one JSON object `{"name": ..., "parameters": {...}}`, after
  `<|python_tag|>` or not (Llama 3.1 / 3.2 / 3.3);
- `mistral`: `[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}` per call.

Other families (DeepSeek's `<｜tool▁calls▁begin｜>`, Granite's `<|tool_call|>`, Command-R's
actions, ...) are refused by name. A call that does not parse, names no tool of the run or
raises is answered with an error message as the tool's result, and counted: never a
crashed run.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from freetx.errors import ConfigError

FORMATS = ("hermes", "llama3", "mistral")
# a template's spelling -> the family it is, and whether freetx parses it
_FAMILIES = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3"),
    ('"parameters"', "llama3"),
)
_UNSUPPORTED = (
    ("tool▁calls▁begin", "DeepSeek's <｜tool▁calls▁begin｜>"),
    ("<|tool_call|>", "Granite's <|tool_call|>"),
    ("<|action_start|>", "InternLM's <|action_start|>"),
    ("<function_calls>", "Claude-style <function_calls>"),
    ("functools[", "Phi-4-mini's functools[...]"),
)
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
_JSON_TYPES.update({list: "array", dict: "object", type(None): "null"})


class ToolCall(NamedTuple):
    """One call parsed from a reply: the tool's name and arguments, or why it does not
    parse (`error`; name and arguments then None)."""

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None

    def as_message_call(self, call_id: str) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` entry (transformers' form), with
        its `id` (its tool message's `tool_call_id`: Mistral's templates need one)."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": call_id, "type": "function", "function": function}


def tool_name(function: Callable[..., Any]) -> str:
    """A tool's name: its function's (a bound method's: the method's)."""
    return getattr(function, "__name__", type(function).__name__)


def _json_type(annotation: Any, where: str) -> dict[str, Any]:
    """The JSON schema of a parameter's annotation (str, int, float, bool, list[...],
    dict, Optional, Literal)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin is typing.Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        kinds = [_json_type(a, where) for a in args if a is not type(None)]
        schema = kinds[0] if len(kinds) == 1 else {"anyOf": kinds}
        return {**schema, "nullable": True} if type(None) in args else schema
    if origin in (list, tuple):
        return {"type": "array", **({"items": _json_type(args[0], where)} if args else {})}
    if origin is dict:
        return {"type": "object"}
    raise ConfigError(
        f"{where} is annotated {annotation!r}, which has no JSON schema a model could read; "
        "annotate it str, int, float, bool, list[...], dict, Optional[...] or Literal[...]."
    )


def _described_arguments(doc: str) -> tuple[str, dict[str, str]]:
    """A Google-style docstring's first paragraph and its `Args:` descriptions."""
    head, _, rest = doc.partition("\nArgs:")
    described: dict[str, str] = {}
    name = None
    for line in rest.splitlines():
        if line.strip() and not line.startswith((" ", "\t")):
            break  # the next section (Returns:)
        found = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?\s*:\s*(.*)", line)
        if found:
            name, described[found[1]] = found[1], found[2].strip()
        elif name and line.strip():
            described[name] += " " + line.strip()
    return head.strip().split("\n\n")[0].replace("\n", " "), described


def tool_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """A tool's JSON schema (transformers' `get_json_schema` form: {"type": "function",
    "function": {"name", "description", "parameters"}}); a ConfigError when it has no
    docstring, or an argument no annotation or no description."""
    name = tool_name(function)
    doc = inspect.getdoc(function)
    if not doc:
        raise ConfigError(
            f"tool {name} has no docstring, and the model reads what a tool does from it; "
            "give it one: a line saying what it does, then `Args:` with a line per argument."
        )
    description, described = _described_arguments(doc)
    hints = typing.get_type_hints(function)
    properties, required = {}, []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        where = f"tool {name}'s argument {parameter.name}"
        if parameter.name not in hints:
            raise ConfigError(f"{where} has no type annotation; annotate it (e.g. `: str`).")
        if parameter.name not in described:
            raise ConfigError(
                f"{where} is not described in the docstring's `Args:` section; add a line "
                f"`{parameter.name}: what it is` there (the model reads it)."
            )
        properties[parameter.name] = {
            **_json_type(hints[parameter.name], where),
            "description": described[parameter.name],
        }
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def tool_format(template: str | None, given: str | None = None) -> str:
    """The tool-call format of a chat template's family (module docstring): `given` (a
    config's `tool_format`) checked, else found from the template's own spelling; a
    ConfigError for a family freetx does not parse, or a template that writes no tools."""
    if given is not None:
        if given not in FORMATS:
            raise ConfigError(
                f"tool_format={given!r} is none of {', '.join(FORMATS)} (the tool-call formats "
                "freetx parses); pick the one the model was trained with."
            )
        return given
    text = template or ""
    for spelling, family in _UNSUPPORTED:
        if spelling in text:
            raise ConfigError(
                f"the chat template writes tool calls as {family}, which freetx does not "
                f"parse (it parses {', '.join(FORMATS)}); use a model of those families, or "
                "set tool_format if this model also reads one of them."
            )
    for spelling, family in _FAMILIES:
        if spelling in text:
            return family
    raise ConfigError(
        "the chat template writes no tool calls that freetx knows (<tool_call>, [TOOL_CALLS], "
        "<|python_tag|>), so the model was not trained to call tools in a format freetx parses; "
        f"set tool_format to one of {', '.join(FORMATS)} if it was, or use a model whose "
        "template renders `tools`."
    )


def _call_of(obj: Any, key: str) -> ToolCall:
    """A parsed JSON call ({"name", key: {...}}), or why it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, None, f"a tool call is a JSON object with a name, not {obj!r:.80}")
    arguments = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(None, None, f"the arguments of {obj['name']} are not a JSON object")
    return ToolCall(obj["name"], arguments)


def _loaded(text: str) -> Any:
    """`text` as JSON, or a ToolCall saying why it is not."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCall(None, None, f"the tool call {text.strip()!r:.80} is not JSON ({e.msg})")


def parse_tool_calls(text: str, fmt: str) -> list[ToolCall]:
    """The calls in a reply's text (its special tokens kept), in format `fmt`; a call that
    does not parse is a ToolCall with its `error`; no call: []."""
    calls = []
    if fmt == "hermes":
        for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, flags=re.S):
            loaded = _loaded(body)
            calls.append(loaded if isinstance(loaded, ToolCall) else _call_of(loaded, "arguments"))
        return calls
    if fmt == "llama3":
        body = text.split("<|python_tag|>", 1)[-1].strip()
        if not body.startswith("{"):
            return []
        loaded = _loaded(body)
        return [loaded if isinstance(loaded, ToolCall) else _call_of(loaded, "parameters")]
    if "[TOOL_CALLS]" not in text:
        return []
    body = text.split("[TOOL_CALLS]", 1)[1].strip()
    if "[ARGS]" in body:  # name[ARGS]{...} per call (Mistral's tokenizer v11 on)
        for part in body.split("[TOOL_CALLS]"):
            name, _, arguments = part.partition("[ARGS]")
            loaded = _loaded(arguments)
            calls.append(
                loaded
                if isinstance(loaded, ToolCall)
                else _call_of({"name": name.strip(), "arguments": loaded}, "arguments")
            )
        return calls
    loaded = _loaded(body)
    if isinstance(loaded, ToolCall):
        return [loaded]
    listed = loaded if isinstance(loaded, list) else [loaded]
    return [_call_of(obj, "arguments") for obj in listed]


def tool_result(
    call: ToolCall,
    tools: Mapping[str, Callable[..., Any]],
    run: Callable[..., Any],
    passing: tuple[type[BaseException], ...] = (),
) -> tuple[str, bool]:
    """What the model reads back for `call`: the tool's result as text (a dict or list as
    JSON), or an error message; and whether it failed. `run(function, **arguments)` calls
    the tool (with the run's deadline); the exceptions `passing` (a deadline passed) are
    raised through, every other one is the model's to read."""
    if call.error is not None:
        return f"Error: {call.error}.", True
    if call.name not in tools:
        known = ", ".join(tools) or "none"
        return f"Error: there is no tool {call.name!r} (the tools are: {known}).", True
    try:
        inspect.signature(tools[call.name]).bind(**call.arguments)
    except TypeError as e:
        return f"Error: {call.name} cannot take these arguments ({e}).", True
    try:
        value = run(tools[call.name], **call.arguments)
    except passing:
        raise
    except Exception as e:  # the tool's own failure, shown to the model
        return f"Error: {call.name} raised {type(e).__name__}: {e}", True
    if isinstance(value, (dict, list)):
        return json.dumps(value), False
    return str(value), False
