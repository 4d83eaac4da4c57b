"""Typed dataclass schemas: a mapping (or dotted overrides) and a dataclass in, a validated
instance or one ConfigError line out.

A schema is a dataclass whose fields carry their type (str, int, float, bool, Literal,
Optional, list, a nested schema) and, for numbers, the range they allow (``allowed(...)``)
or that they hold a path (``path_field()``). Building from a mapping refuses unknown keys
with a close-match suggestion and missing required values; ``check_fields``, run by each
schema's ``__post_init__``, checks every field's type and range whatever filled it. Every
refusal names the key, the value and what is allowed, in one line. The recipe
(``edgetl.recipe``) is such a schema.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

from edgetl.errors import ConfigError


@dataclass(frozen=True)
class Allowed:
    """The numbers a recipe field allows besides its type: finite, within the bounds given, or one of choices.

    An Optional field also allows null; a list field's bounds apply to each item.
    """

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    choices: tuple = ()

    def admits(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.choices:
            return value in self.choices
        return ((self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                and (self.lt is None or value < self.lt) and (self.le is None or value <= self.le))

    def describe(self, integer: bool) -> str:
        if self.choices:
            return ", ".join(map(str, self.choices))
        low = ("(", self.gt) if self.gt is not None else ("[", self.ge) if self.ge is not None else None
        high = (")", self.lt) if self.lt is not None else ("]", self.le) if self.le is not None else None
        if low and high:
            kind = "an integer" if integer else "a fraction" if low[1] >= 0 and high[1] <= 1 else "a finite number"
            return f"{kind} in {low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
        kind = "an integer" if integer else "a finite number"
        if low:
            return f"{kind} {'>' if low[0] == '(' else '>='} {_num(low[1])}"
        if high:
            return f"{kind} {'<' if high[0] == ')' else '<='} {_num(high[1])}"
        return kind


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def allowed(default: Any = dataclasses.MISSING, **bounds) -> Any:
    """A dataclass field whose numbers ``Allowed(**bounds)`` admits (checked by ``check_fields``)."""
    return dataclasses.field(default=default, metadata={"allowed": Allowed(**bounds)})


def path_field(default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field holding a path or a name: a non-empty string without control characters."""
    return dataclasses.field(default=default, metadata={"path": True})




def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _type_name(tp) -> str:
    if _is_union(tp):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def show(value: Any, limit: int = 60) -> str:
    """A value as a message shows it: its repr, cut to ``limit`` characters (one line)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        bits = value.bit_length()  # str() of more than 4300 digits raises
        digits = len(str(abs(value))) if bits < 14_000 else f"about {int(bits * math.log10(2)) + 1}"
        return f"{'-' if value < 0 else ''}an integer of {digits} digits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _at(source: str, key: str) -> str:
    return f"{source}: {key}" if source else key


def _check_value(value: Any, tp, key: str, source: str) -> Any:
    """Return ``value`` converted to ``tp`` (int -> float only) or raise a one-line ConfigError."""
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_value(value, arg, key, source)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"{_at(source, key)} is {show(value)}; allowed: {_type_name(tp)}")
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, str) and value in choices:
            return value
        hint = ""
        if isinstance(value, str) and len(value) < 100:
            close = difflib.get_close_matches(value, [str(a) for a in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{_at(source, key)} is {show(value)}{hint}; allowed: {', '.join(repr(a) for a in choices)}"
        )
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{_at(source, key)} is {show(value)}; allowed: {_type_name(tp)}")
        (item,) = typing.get_args(tp)
        return [_check_value(v, item, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return build(tp, value, key, source)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(tp)
    if ok is None:
        raise TypeError(f"recipe schema uses unsupported type {tp}")
    if not ok:
        raise ConfigError(f"{_at(source, key)} is {show(value)}; allowed: {_type_name(tp)}")
    if tp is float:
        try:
            return float(value)
        except OverflowError:  # an integer past 1.8e308
            raise ConfigError(f"{_at(source, key)}: {show(value)} is not allowed; allowed: a finite number") from None
    return value


def _base_type(tp):
    """int for ``int``, ``int | None`` and ``list[int] | None``."""
    while _is_union(tp) or typing.get_origin(tp) is list:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def check_fields(obj, where: str) -> None:
    """Check every field of a recipe section: its type (ints become floats where a float is
    expected), then numbers against the field's ``Allowed`` (finite, in range) and paths."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{where}.{f.name}" if where else f.name
        value = _check_value(getattr(obj, f.name), hints[f.name], key, "")
        setattr(obj, f.name, value)
        if value is None:
            continue
        rule = f.metadata.get("allowed")
        if rule is not None:
            items = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
            for item_key, item in items:
                if not rule.admits(item):
                    optional = type(None) in typing.get_args(hints[f.name])
                    text = rule.describe(integer=_base_type(hints[f.name]) is int)
                    null = " or null" if optional and not isinstance(value, list) else ""
                    raise ConfigError(f"{item_key}: {show(item)} is not allowed; allowed: {text}{null}")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: {show(value)} is not allowed; allowed: a finite number")
        if f.metadata.get("path") and (not value or not value.isprintable()):
            raise ConfigError(f"{key}: {show(value)} is not allowed; allowed: a path or name "
                              "(not empty, no control characters)")


def build(cls, data: Any, prefix: str, source: str):
    where = prefix or "top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where} must be a mapping of keys to values, got {show(data)}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            full = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1) if len(str(key)) < 100 else []
            hint = f"; did you mean {(prefix + '.' if prefix else '') + close[0]!r}?" if close else ""
            raise ConfigError(
                f"{source}: unknown key {show(full)}{hint} (allowed in {where}: {', '.join(fields)})"
            )
    kwargs = {}
    for name, f in fields.items():
        full = f"{prefix}.{name}" if prefix else name
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in data:
            if required:
                raise ConfigError(f"{source}: missing required value {full} ({_type_name(hints[name])})")
            continue
        kwargs[name] = _check_value(data[name], hints[name], full, source)
    return cls(**kwargs)




# --- dotted keys ---------------------------------------------------------------------


_YAML_NULLS = ("", "~", "null", "Null", "NULL")


def parse_value(root: type, key: str, text: str) -> Any:
    """CLI text for the dotted ``key`` of the schema ``root``, read as the key's type wants
    (see ``edgetl.recipe.parse_override``)."""
    from edgetl.io import yaml_loads

    tp = schema_type(root, key.split("."))
    plain = text.strip()
    if tp is not None and _accepts_str(tp) and not plain.startswith(("'", '"')):
        return None if plain in _YAML_NULLS and _accepts_none(tp) else plain
    if not plain:
        return None
    try:
        parsed = yaml_loads(text, f"--set {key}")
    except ConfigError:  # not YAML (or refused, e.g. an alias): the text, for the type check to name
        return text
    if isinstance(parsed, str) and tp is not None and _accepts(tp, float):
        try:
            return float(parsed)  # YAML 1.1 spells them .nan / .inf; "nan" and "inf" mean them too
        except ValueError:
            pass
    return parsed


def schema_type(root: type, path: list[str]):
    """Type of a dotted key in the schema ``root``, or None if the key does not exist."""
    tp: Any = root
    for part in path:
        if _is_union(tp):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if not dataclasses.is_dataclass(tp):
            return None
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def set_dotted(root: type, data: dict, overrides: dict[str, Any], source: str) -> dict:
    """A copy of ``data`` (a mapping for the schema ``root``) with dotted keys set; text for a
    non-text key is read as ``parse_value`` reads it. An unknown key is refused."""
    data = copy.deepcopy(data)
    for key, value in overrides.items():
        parts = key.split(".")
        tp = schema_type(root, parts)
        if tp is None:
            keys = all_keys(root)
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{source}: unknown key {key!r}{hint}")
        if isinstance(value, str) and not _accepts_str(tp):
            value = parse_value(root, key, value)
        node = data
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            elif not isinstance(node[part], dict):  # never silently replaced
                raise ConfigError(f"{source}: {'.'.join(parts[: i + 1])} is {show(node[part])}; allowed: a mapping")
            node = node[part]
        node[parts[-1]] = value
    return data


def _accepts(tp, kind) -> bool:
    return tp is kind or (_is_union(tp) and kind in typing.get_args(tp))


def _accepts_none(tp) -> bool:
    return _is_union(tp) and type(None) in typing.get_args(tp)


def _accepts_str(tp) -> bool:
    if tp is str:
        return True
    if typing.get_origin(tp) is Literal:
        return True
    if _is_union(tp):
        return any(_accepts_str(a) for a in typing.get_args(tp))
    return False


def all_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for name, tp in typing.get_type_hints(cls).items():
        if _is_union(tp):
            inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
            tp = inner[0] if inner else tp
        if dataclasses.is_dataclass(tp):
            keys += all_keys(tp, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


