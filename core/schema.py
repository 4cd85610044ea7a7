"""One strict schema for everything that crosses a process boundary.

Records become JSON values through `unstructure` and come back through `structure`,
both over one cattrs converter that coerces nothing: a bool is not an int, "3" is not
an int, 3.5 is not an int, None is taken only where a field is Optional, a string or an
object is not a list, and unknown keys are refused. What comes off the wire may come
from an older peer or a hostile one; a silent coercion would turn a bug on one side
into a wrong value on the other.

Record modules register their own hooks here (a layout travels as its specs and is
re-planned), so this module knows no record.
"""

from __future__ import annotations

import base64
import binascii
import collections.abc
import enum
import math
import re
from collections.abc import Callable, Iterator
from typing import Any, NewType, Self, TypeVar, get_args, get_origin

import attrs
import cattrs
from cattrs.cols import homogenous_tuple_structure_factory, is_mapping, list_structure_factory
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, mapping_structure_factory
from cattrs.v import format_exception

from .errors import InvalidArgumentError

T = TypeVar("T")

_MAX_PROBLEMS = 5  # a message names the first few; a hostile one may hold thousands


class Refused(ValueError):
    """A value of the wrong type or out of range; the message says what was wanted."""


def show(value: Any) -> str:
    """A value as an error message quotes it: its repr, cut short."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300-digit limit for str()
        return f"an int of {value.bit_length()} bits"
    return text if len(text) <= 80 else text[:77] + "..."


converter = cattrs.Converter(
    forbid_extra_keys=True,
    # JSON has lists only: tuples go out as lists, as the hand-written forms sent them.
    unstruct_collection_overrides={collections.abc.Sequence: list, tuple: list},
)


def _exact(kind: type, want: str) -> Callable[[Any, Any], Any]:
    def hook(value: Any, _: Any) -> Any:
        # bool is an int to Python, never to a schema
        if isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool):
            return value
        raise Refused(f"must be {want}, got {show(value)}")

    return hook


def _float(value: Any, _: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            if math.isfinite(number := float(value)):  # JSON ints are numbers too
                return number
        except OverflowError:  # an int of 400 digits
            pass
    raise Refused(f"must be a finite number, got {show(value)}")


def _bytes(value: Any, _: Any) -> bytes:
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            pass
    raise Refused(f"must be base64 text, got {show(value)}")


def _enum(value: Any, cls: type[enum.Enum]) -> enum.Enum:
    try:
        return cls(value)
    except ValueError:
        raise Refused(f"must be one of {[m.value for m in cls]}, got {show(value)}") from None


def _is_sequence(t: Any) -> bool:
    return get_origin(t) in (list, tuple, collections.abc.Sequence)


def _sequence(t: Any, conv: cattrs.Converter) -> Callable[[Any, Any], Any]:
    """Lists and tuples from a JSON list only: cattrs alone would take any iterable, so
    a string would pass as a list of characters and an object as a list of its keys."""
    args = get_args(t)
    fixed = get_origin(t) is tuple and not (len(args) == 2 and args[1] is Ellipsis)
    if fixed:  # tuple[int, int]: exactly that many items
        hooks = [conv.get_structure_hook(a) for a in args]

        def items(value: Any, _: Any) -> Any:
            if len(value) != len(args):
                raise Refused(f"must hold {len(args)} items, got {show(value)}")
            out, errors = [], []
            for i, (hook, v, a) in enumerate(zip(hooks, value, args, strict=True)):
                try:
                    out.append(hook(v, a))
                except Exception as exc:  # noted with its index, as cattrs notes a list's
                    exc.__notes__ = [*getattr(exc, "__notes__", []), IterableValidationNote(f"index {i}", i, a)]
                    errors.append(exc)
            if errors:
                raise IterableValidationError(f"While structuring {t!r}", errors, t)
            return tuple(out)
    else:
        factory = homogenous_tuple_structure_factory if get_origin(t) is tuple else list_structure_factory
        items = factory(t, conv)  # type: ignore[assignment]  # cattrs' factories are untyped hooks

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, (list, tuple)):
            raise Refused(f"must be a list, got {show(value)}")
        return items(value, t)

    return hook


def _record(cls: type, conv: cattrs.Converter) -> Callable[[Any, Any], Any]:
    """An attrs class from a JSON object only, its keys checked by the generated hook."""
    structure: Callable[[Any, Any], Any] = make_dict_structure_fn(cls, conv)

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise Refused(f"must be an object, got {show(value)}")
        return structure(value, cls)

    return hook


def _mapping(t: Any, conv: cattrs.Converter) -> Callable[[Any, Any], Any]:
    structure = mapping_structure_factory(t, conv)  # into a dict, keys and values checked

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise Refused(f"must be an object, got {show(value)}")
        return structure(value, t)

    return hook


converter.register_structure_hook(int, _exact(int, "an int"))
converter.register_structure_hook(str, _exact(str, "a string"))
converter.register_structure_hook(bool, _exact(bool, "a boolean"))
converter.register_structure_hook(float, _float)
converter.register_structure_hook(bytes, _bytes)
converter.register_unstructure_hook(bytes, lambda b: base64.b64encode(b).decode())
converter.register_structure_hook_factory(lambda t: isinstance(t, type) and issubclass(t, enum.Enum), lambda t: _enum)
converter.register_structure_hook_factory(_is_sequence, _sequence)
converter.register_structure_hook_factory(is_mapping, _mapping)
converter.register_structure_hook_factory(attrs.has, _record)


def refined(name: str, base: type[T], want: str, test: Callable[[T], bool]) -> Any:
    """A `NewType` of `base` whose values must also pass `test`: "an int in [0, 2**63)"."""
    new = NewType(name, base)  # type: ignore[misc, valid-type]  # a NewType made at run time

    def hook(value: Any, _: Any) -> T:
        try:
            ok = test(checked := converter.structure(value, base))
        except Refused:
            ok = False
        if not ok:
            raise Refused(f"must be {want}, got {show(value)}")
        return checked

    converter.register_structure_hook(new, hook)
    return new


# -- one message from cattrs' tree of errors ------------------------------------------------


def _problems(exc: BaseException, path: str) -> Iterator[str]:
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            step = f".{note.name}" if isinstance(note, AttributeValidationNote) else f"[{note.index!r}]"
            yield from _problems(sub, path + step)
        for sub in without:
            yield from _problems(sub, path)
    elif isinstance(exc, KeyError):
        yield f"{path} is missing"
    elif isinstance(exc, ForbiddenExtraKeysError):
        yield f"{path} has unexpected keys {sorted(exc.extra_fields)}"
    elif isinstance(exc, Refused):
        yield f"{path} {exc}"
    elif isinstance(exc, InvalidArgumentError):  # a record's own check, in its words
        yield f"{path}: {exc}"
    else:  # a check cattrs made itself
        yield f"{path}: {format_exception(exc, None)}"


def _noun(cls: type) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", " ", cls.__name__).lower()  # RegistryStatus: registry status


def problem(exc: BaseException, cls: type) -> str:
    """One message naming `cls` and each wrong field: "malformed lease: Lease.version
    must be an int, got '3'"."""
    found = list(_problems(exc, cls.__name__))
    more = f"; and {len(found) - _MAX_PROBLEMS} more" if len(found) > _MAX_PROBLEMS else ""
    return f"malformed {_noun(cls)}: " + "; ".join(found[:_MAX_PROBLEMS]) + more


def structure(data: Any, cls: type[T], error: type[InvalidArgumentError] = InvalidArgumentError) -> T:
    """`data`, JSON values, as a `cls`.

    Args:
        data: What `unstructure` made (or anything a peer sent).
        cls: The record class.
        error: The error to raise, `InvalidArgumentError` or a subclass.

    Raises:
        InvalidArgumentError: `error`, naming the class and every wrong field.
    """
    try:
        return converter.structure(data, cls)
    except (BaseValidationError, Refused, InvalidArgumentError) as exc:
        raise error(problem(exc, cls)) from None


def unstructure(obj: Any, cls: type | None = None) -> Any:
    """`obj` as JSON values: what `structure` takes back."""
    return converter.unstructure(obj, cls)


def as_object(obj: Any, cls: type) -> dict[str, Any]:
    """A record as a JSON object (`unstructure` of an attrs class)."""
    out = converter.unstructure(obj, cls)
    assert isinstance(out, dict)
    return out


class Record:
    """`to_dict` and `from_dict` for an attrs class that crosses a process boundary: its
    JSON object through the converter, and back, refused with `InvalidArgumentError`
    naming the field where anything is off."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON object."""
        return as_object(self, type(self))

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        """The record `to_dict` made.

        Raises:
            InvalidArgumentError: Naming every field where anything is off.
        """
        return structure(data, cls)
