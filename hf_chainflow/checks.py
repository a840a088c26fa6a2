"""The argument checks every layer shares, one function per rule (standard library only, so any module may import
it, `hf_chainflow.fileio` and the configs included).

Each check raises a `ValueError` in the project's style: the argument in backticks, the rule, the value received,
e.g. `` `batch_size` must be a positive integer, got 0. ``
"""

from __future__ import annotations


def is_int(value) -> bool:
    """An `int` that is not a `bool` (`True` is an `int` to Python, never a count or a size here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An `int` or a `float` that is not a `bool`."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int_message(name: str, value, *, optional: bool = False, meaning: str = "", none: str = "",
                         owner: str = "") -> str:
    """The refusal of `check_positive_int` (for callers that raise another error type):
    `` {owner}`{name}` must be a positive integer ({meaning}) or None ({none}), got {value!r}. ``, the parts in
    parentheses only when given, `or None` only when `optional`."""
    rule = "a positive integer" + (f" ({meaning})" if meaning else "")
    if optional:
        rule += " or None" + (f" ({none})" if none else "")
    return f"{owner}`{name}` must be {rule}, got {value!r}."


def check_positive_int(name: str, value, *, optional: bool = False, meaning: str = "", none: str = "",
                       owner: str = "") -> None:
    """`value` must be an int >= 1 (not a bool), or None when `optional`; else a `ValueError` naming `name`
    (`positive_int_message`: `meaning` says what the number counts, `none` what None means, `owner` prefixes the
    name, e.g. "ChainFlow vLLM setting ")."""
    if (optional and value is None) or (is_int(value) and value >= 1):
        return
    raise ValueError(positive_int_message(name, value, optional=optional, meaning=meaning, none=none, owner=owner))


def check_choice(name: str, value, allowed) -> None:
    """`value` must be one of `allowed`; else a `ValueError` naming `name` and the choices."""
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {allowed}, got {value!r}.")


__all__ = ["check_choice", "check_positive_int", "is_int", "is_number", "positive_int_message"]
