"""JSON Schema keywords the grammar backend would silently get wrong, refused up front with their place.

xgrammar compiles most of Draft 2020-12 but ignores or mis-enforces a few keywords (measured in
``shared/reference/constrained_frontend.md`` §1.2: ``allOf`` not enforced, ``uniqueItems`` ignored,
``patternProperties`` rejecting valid instances; vLLM routes the same set away from xgrammar), and drops two
combinations with only a warning on stderr (measured on JSONSchemaBench): string
lengths beside a ``pattern``, and ``multipleOf`` beside a range. An output that silently breaks the user's
schema is worse than a 400 that names the keyword, so these are errors. ``oneOf`` compiles as ``anyOf``
(an output may match several branches only where they overlap); it is accepted, and documented. A ``$ref``
must point into the schema itself (``#...``): the backend never fetches a remote document, and would leave
such a reference unenforced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ninfer.contract.constraint import ConstraintError

UNSUPPORTED = {
    "allOf": "allOf is not enforced by the grammar backend; merge the subschemas into one",
    "not": "'not' cannot be compiled into a grammar",
    "if": "if/then/else cannot be compiled into a grammar",
    "then": "if/then/else cannot be compiled into a grammar",
    "else": "if/then/else cannot be compiled into a grammar",
    "uniqueItems": "uniqueItems cannot be enforced by a grammar",
    "contains": "contains cannot be enforced by the grammar backend",
    "minContains": "minContains cannot be enforced by the grammar backend",
    "maxContains": "maxContains cannot be enforced by the grammar backend",
    "patternProperties": "patternProperties is not supported by the grammar backend",
    "propertyNames": "propertyNames is not supported by the grammar backend",
    "dependentSchemas": "dependentSchemas cannot be compiled into a grammar",
    "dependentRequired": "dependentRequired cannot be compiled into a grammar",
    "dependencies": "dependencies cannot be compiled into a grammar",
    "unevaluatedItems": "unevaluatedItems is not supported by the grammar backend",
    "$dynamicRef": "$dynamicRef is not supported by the grammar backend",
}
# String formats the backend knows; any other ``format`` would be unchecked text.
FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uri", "uri-reference", "uri-template",
                     "uuid", "ipv4", "ipv6", "hostname", "idn-email", "idn-hostname", "iri", "iri-reference",
                     "json-pointer", "relative-json-pointer", "regex"})
# Keywords whose values are schemas (one, a list, or a name -> schema map).
_ONE = ("additionalProperties", "items", "additionalItems", "unevaluatedProperties", "contentSchema")
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions")


def check_schema(schema: Any, path: str = "#") -> None:
    """Raise ``ConstraintError`` naming the first unsupported keyword (with its JSON pointer) in ``schema``."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise ConstraintError(f"JSON schema at {path} must be an object or a boolean, got {type(schema).__name__}")
    for key, why in UNSUPPORTED.items():
        if key in schema:
            raise ConstraintError(f"JSON schema at {path}: {why}")
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise ConstraintError(f"JSON schema at {path}: minLength/maxLength beside a pattern are not enforced by "
                              f"the grammar backend; put the length into the pattern")
    if "multipleOf" in schema and any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum",
                                                            "exclusiveMaximum")):
        raise ConstraintError(f"JSON schema at {path}: multipleOf beside a minimum or maximum is not enforced by "
                              f"the grammar backend")
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise ConstraintError(f"JSON schema at {path}: $ref {ref!r} is not a local reference ('#' or '#/...'); "
                              f"remote references are not fetched")
    fmt = schema.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise ConstraintError(f"JSON schema at {path}: string format {fmt!r} is not supported "
                              f"(supported: {', '.join(sorted(FORMATS))})")
    for key in _ONE:
        if key in schema and not isinstance(schema[key], bool):
            check_schema(schema[key], f"{path}/{key}")
    for key in _MANY:
        if key in schema:
            subs = schema[key]
            if not isinstance(subs, list):
                raise ConstraintError(f"JSON schema at {path}/{key} must be a list of schemas")
            for i, sub in enumerate(subs):
                check_schema(sub, f"{path}/{key}/{i}")
    for key in _MAP:
        if key in schema:
            subs = schema[key]
            if not isinstance(subs, Mapping):
                raise ConstraintError(f"JSON schema at {path}/{key} must map names to schemas")
            for name, sub in subs.items():
                check_schema(sub, f"{path}/{key}/{name}")
