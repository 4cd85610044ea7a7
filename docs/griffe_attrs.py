"""A griffe extension for the API reference: the `__init__` that attrs writes for a class
decorated `@attrs.define`, `@attrs.frozen` or `@attrs.mutable`, so that the reference shows
its signature and checks its docstring's `Args:` against it (griffe knows only dataclasses).
mkdocs.yml loads it; mkdocs leaves it out of the site."""

from __future__ import annotations

from typing import Any

import griffe

DECORATORS = {"attrs.define", "attrs.frozen", "attrs.mutable", "attr.s", "attr.attrs", "attr.define", "attr.frozen"}
FIELDS = {"attrs.field", "attr.ib", "attr.attrib", "attr.field"}


def _call_args(expr: Any) -> dict[str, Any]:
    if not isinstance(expr, griffe.ExprCall):
        return {}
    return {a.name: a.value for a in expr.arguments if hasattr(a, "name")}


def _decorator(cls: griffe.Class) -> Any:
    for decorator in cls.decorators:
        value = decorator.value
        if isinstance(value, griffe.Expr) and value.canonical_path in DECORATORS:
            return value
    return None


def _parameters(cls: griffe.Class) -> list[griffe.Parameter]:
    options = _call_args(_decorator(cls))
    if options.get("init") == "False":
        return []
    kw_only = options.get("kw_only") == "True"
    out = []
    for member in cls.members.values():
        if member.is_alias or not member.is_attribute or member.annotation is None:
            continue
        if "property" in member.labels or (
            "class-attribute" in member.labels and "instance-attribute" not in member.labels
        ):
            continue  # a property or a ClassVar
        value = member.value
        field = _call_args(value) if isinstance(value, griffe.Expr) and value.canonical_path in FIELDS else None
        if field is not None and field.get("init") == "False":
            continue
        if field is None:
            default = value
        elif "factory" in field:
            default = griffe.ExprCall(function=field["factory"], arguments=[])
        else:
            default = field.get("default")
        name = str(field["alias"]).strip("'\"") if field and "alias" in field else member.name.lstrip("_")
        kind = (
            griffe.ParameterKind.keyword_only
            if kw_only or (field or {}).get("kw_only") == "True"
            else griffe.ParameterKind.positional_or_keyword
        )
        out.append(griffe.Parameter(name, annotation=member.annotation, kind=kind, default=default))
    return out


def _set_init(cls: griffe.Class) -> None:
    if "__init__" in cls.members or _decorator(cls) is None:
        return
    parameters = []
    try:
        mro = cls.mro()
    except ValueError:
        mro = []
    for parent in reversed(mro):
        if _decorator(parent) is not None:
            parameters += _parameters(parent)
    parameters += _parameters(cls)
    by_name = {p.name: p for p in parameters}  # a subclass's field replaces its base's
    ordered = [p for p in by_name.values() if p.kind is not griffe.ParameterKind.keyword_only]
    ordered += [p for p in by_name.values() if p.kind is griffe.ParameterKind.keyword_only]
    self_ = griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)
    init = griffe.Function("__init__", lineno=0, endlineno=0, parent=cls, returns="None")
    init.parameters = griffe.Parameters(self_, *ordered)
    cls.set_member("__init__", init)


def _walk(obj: griffe.Module | griffe.Class, seen: set[str]) -> None:
    if obj.canonical_path in seen:
        return
    seen.add(obj.canonical_path)
    if isinstance(obj, griffe.Class):
        _set_init(obj)
    for member in list(obj.members.values()):
        if not member.is_alias and (member.is_module or member.is_class):
            _walk(member, seen)


class AttrsInit(griffe.Extension):
    """Writes each attrs class's `__init__` once its package is loaded (its bases too)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _walk(pkg, set())
