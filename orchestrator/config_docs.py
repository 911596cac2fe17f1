"""`docs/configuration.md`, generated from the pydantic models (`archipelago config docs`).

The models are the one source of truth for every field's type, default, constraint and
meaning; the page is rendered from them and a test fails when the committed page differs,
so the reference cannot drift from the code the way a hand-kept table does.
"""

from __future__ import annotations

import enum
import json
import types
import typing
from typing import Any

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from archipelago.workers.tasks.digits_task import DigitsConfig
from archipelago.workers.tasks.hf_task import HFTaskConfig
from archipelago.workers.tasks.lm_task import LMTaskConfig

from .config import RunConfig

COMMAND = "archipelago config docs --out docs/configuration.md"
# The sections by what a user sets, in the order a reader meets them; every section is in one
# (the page is refused otherwise). The run's own fields come first in its group, in their table.
RUN_GROUP = "The run"
GROUPS: dict[str, tuple[str, ...]] = {
    RUN_GROUP: ("task", "warm_start", "ray"),
    "The islands": ("islands", "inner", "compression"),
    "The mode and its outer step": ("mode", "outer", "coordinator", "robust"),
    "The fleet's elasticity": ("elastic",),
    "Outputs": ("evaluation", "checkpoint", "records", "tracking", "export"),
    "The control plane": ("api",),
}
# Bundled tasks whose `task.kwargs` are documented beside the run config.
TASKS: dict[str, type[BaseModel]] = {
    "archipelago.workers.tasks.lm_task:make_task": LMTaskConfig,
    "archipelago.workers.tasks.hf_task:make_task": HFTaskConfig,
    "archipelago.workers.tasks.digits_task:make_task": DigitsConfig,
}


def _type(annotation: Any, inlined: dict[type[BaseModel], str]) -> str:
    """How a field's type reads in a table; `inlined`: models whose fields are rows of this
    table under a dotted name (named, not linked)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # a union member with bounds of its own (`_constraints` reads them)
        return _type(args[0], inlined)
    if origin is typing.Literal:
        return " \\| ".join(f"`{getattr(a, 'value', a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        text = " \\| ".join(_type(a, inlined) for a in inner)
        return f"{text} \\| null" if len(inner) < len(args) else text
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        name = _section_name(annotation)
        return f"`{name}` (as `{inlined[annotation]}`)" if annotation in inlined else f"[{name}](#{_anchor(name)})"
    if origin in (list, tuple, dict):
        parts = ", ".join("…" if a is Ellipsis else _type(a, inlined) for a in args)
        return f"{origin.__name__}[{parts}]"
    return getattr(annotation, "__name__", str(annotation))


def _inlined() -> dict[type[BaseModel], str]:
    """Models that are a field of a section, with that field's dotted name: their fields
    are rows of the section's table (`simulation.link.preset`), not a heading to link to."""
    return {
        f.annotation: f"{section}.{name}"
        for section, s in RunConfig.model_fields.items()
        if isinstance(s.annotation, type) and issubclass(s.annotation, BaseModel)
        for name, f in s.annotation.model_fields.items()
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
    }


def _section_name(model: type[BaseModel]) -> str:
    for name, field in RunConfig.model_fields.items():
        if field.annotation is model:
            return name
        if model in _members(field.annotation):
            return _member_title(name, model)
    return model.__name__


def _members(annotation: Any) -> list[type[BaseModel]]:
    """The models of a union of models (the `mode` section's settings, one per mode)."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return []
    return [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]


def _tag(model: type[BaseModel]) -> str:
    """A union member's discriminator value (`async`)."""
    tag = model.model_fields["name"].get_default()
    return str(getattr(tag, "value", tag))


def _member_title(section: str, model: type[BaseModel]) -> str:
    """`mode: async`: the union's member by its discriminator's value."""
    return f"{section}: {_tag(model)}"


def _anchor(title: str) -> str:
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def _value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return f"`{json.dumps(value, default=str)}`"


def _constraints(field: FieldInfo) -> str:
    bounds = {at.Ge: ("≥", "ge"), at.Gt: (">", "gt"), at.Le: ("≤", "le"), at.Lt: ("<", "lt")}
    out = []
    metadata = list(field.metadata)
    for member in typing.get_args(field.annotation):  # `int` bounded inside `int | Literal["auto"]`
        if typing.get_origin(member) is typing.Annotated:
            for meta in member.__metadata__:
                metadata += meta.metadata if isinstance(meta, FieldInfo) else [meta]
    for meta in metadata:
        for kind, (symbol, attr) in bounds.items():
            if isinstance(meta, kind):
                out.append(f"{symbol} {getattr(meta, attr)}")
        if getattr(meta, "pattern", None):
            out.append(f"matches `{meta.pattern}`")
    return ", ".join(out)


# a section of the run config: (its field, its heading, its model); one heading per mode for `mode`
Section = tuple[str, str, type[BaseModel]]


def _rows(prefix: str, model: type[BaseModel]) -> tuple[list[str], list[Section]]:
    rows: list[str] = []
    sections: list[Section] = []
    inlined = _inlined()
    if model is not RunConfig:  # its own model fields are rows of its table too (`simulation.link`)
        inlined |= {
            f.annotation: f"{prefix}{name}"
            for name, f in model.model_fields.items()
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
        }
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if model is RunConfig and (members := _members(annotation)):  # a section of one model per mode
            sections += [(name, _member_title(name, m), m) for m in members]
            kinds = " \\| ".join(f"[`{_tag(m)}`](#{_anchor(_member_title(name, m))})" for m in members)
            tag = _value(field.get_default(call_default_factory=True).name)
            rows.append(f"| `{name}` | {kinds} | {tag} |  | {field.description or ''} |")
            continue
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if model is RunConfig:  # a section of its own
                sections.append((name, name, annotation))
            else:  # a model inside a section: its fields, dotted (`simulation.link.preset`)
                rows += _rows(f"{prefix}{name}.", annotation)[0]
            continue
        default = "required" if field.is_required() else _value(field.get_default(call_default_factory=True))
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(
            f"| `{prefix}{field.alias or name}` | {_type(annotation, inlined)} | {default} | {_constraints(field)} | {description} |"
        )
    return rows, sections


def field_table(prefix: str, model: type[BaseModel]) -> tuple[list[str], list[Section]]:
    """The markdown table of `model`'s fields, each dotted under `prefix`, and its sections
    (`simulation.md` renders the simulated fleet's with it)."""
    rows, sections = _rows(prefix, model)
    head = ["| field | type | default | constraint | meaning |", "| --- | --- | --- | --- | --- |"]
    return head + rows, sections


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def render() -> str:
    """The whole page, deterministic (a test compares it with the committed file)."""
    out = [
        "# Configuration reference",
        "",
        f"Generated from the pydantic models by `{COMMAND}`; do not edit by hand (a test fails",
        "when this page and the models disagree).",
        "",
        "A run is configured by YAML (`archipelago run --config my.yaml`; `archipelago config show` prints",
        "the resolved config, and `archipelago config show --mode async` a run of that mode's, with only the",
        "mode settings such a run reads) and dotted overrides (`--set outer.lr=0.5 --set islands.count=2`). Unknown",
        "keys and out-of-range values are errors that name the field (`outer.lr: Input should be greater",
        "than 0`); the run exits with status 2 and nothing starts. `null` in YAML is `None`.",
        "",
    ]
    table, sections = field_table("", RunConfig)
    by_section: dict[str, list[Section]] = {}
    for section in sections:
        by_section.setdefault(section[0], []).append(section)
    grouped = [s for names in GROUPS.values() for s in names]
    if sorted(grouped) != sorted(by_section):
        raise ValueError(f"GROUPS names {sorted(grouped)}, the config has {sorted(by_section)}")
    for group, names in GROUPS.items():
        out += [f"## {group}", ""]
        if group == RUN_GROUP:  # the run's own fields first
            out += [_doc(RunConfig), "", *table, ""]
        for key, heading, model in (entry for s in names for entry in by_section[s]):
            out += [f"### {heading}", "", _doc(model), ""]
            out += [*field_table(f"{key}.", model)[0], ""]
    out += [
        "## Bundled tasks' `task.kwargs`",
        "",
        "Each task validates its own keyword arguments before anything starts (errors name",
        "`task.kwargs.<field>`). How to write your own task: [tasks.md](tasks.md).",
        "",
    ]
    nested: dict[str, type[BaseModel]] = {}
    for factory, model in TASKS.items():
        out += [f"### `{factory}`", "", _doc(model), ""]
        out += [*field_table("task.kwargs.", model)[0], ""]
        for name, field in model.model_fields.items():
            nested.update({f"task.kwargs.{name}[]": m for m in _models_in(field.annotation)})
    for prefix, model in nested.items():  # models the task tables link to, each once
        out += [f"### {model.__name__}", "", _doc(model), ""]
        out += [*field_table(f"{prefix}.", model)[0], ""]
    return "\n".join(out)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation such as `list[PreparedSource]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]
