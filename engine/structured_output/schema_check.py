"""Refuse a JSON schema the grammar compiler would silently get wrong, or could not bear.

xgrammar compiles most of JSON Schema, but it ignores a few keywords without a word
(measured with xgrammar 0.2.8: an instance that breaks `not`, `if`/`then`/`else` or the
second schema of an `allOf` is still generated), and it accepts schemas that are not
valid JSON Schema at all (`"minItems": -1`). Either would hand the client output that
fails its own validator, so both are a 400 naming the place in the schema.

Two more never reach the compiler: a schema nested deeper than MAX_DEPTH (the checks
below, jsonschema's included, recurse per level: measured first, without recursion), and
`$ref`s with no way out, which describe no JSON value at all. xgrammar 0.2.8 compiles
`{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}` into a grammar that ends
nothing (a 200 with empty or cut-off text), and a required property that refers back to
its own object (`{"properties": {"x": {"$ref": "#"}}, "required": ["x"]}`) makes it
allocate until the process is killed.
"""

from __future__ import annotations

from typing import Any

import jsonschema

# Arrays and objects inside one another, as the server's body reader counts them.
MAX_DEPTH = 64

# Keywords whose value is a schema or a list of schemas (and below, _MAP: name -> schema):
# the walk follows only these, so a property *named* "not" is never mistaken for one.
_SCHEMAS = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedItems",
            "unevaluatedProperties", "not", "if", "then", "else", "prefixItems", "allOf",
            "anyOf", "oneOf")  # fmt: skip
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

UNSUPPORTED = {
    "not": "`not` is not supported",
    "if": "`if`/`then`/`else` are not supported",
    "then": "`if`/`then`/`else` are not supported",
    "else": "`if`/`then`/`else` are not supported",
    "$dynamicRef": "`$dynamicRef` is not supported",
}


Nodes = list[tuple[tuple[str, ...], dict[str, Any]]]  # object schemas with their paths


def check_json_schema(schema: Any) -> None:
    """ValueError naming what is wrong: nested too deep, not valid JSON Schema, a keyword
    not honoured, or `$ref`s that never end."""
    if not isinstance(schema, dict | bool):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    _check_depth(schema)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = _pointer(exc.path)
        raise ValueError(f"is not a valid JSON Schema: {exc.message} (at {where})") from None
    nodes = _walk(schema)
    _check_supported(nodes)
    _check_refs_end(schema, nodes)


def _check_depth(schema: Any) -> None:
    """ValueError when arrays and objects nest deeper than MAX_DEPTH (a schema given as an
    object came through the body reader's limit already; one given as text did too, but
    the engine's own callers pass Python values)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict | list) and len(path) >= MAX_DEPTH:
            raise ValueError(f"is nested more than {MAX_DEPTH} levels deep (at "
                             f"{_pointer(path[:8])}...); the limit is {MAX_DEPTH}")  # fmt: skip
        if isinstance(node, dict):
            stack.extend((v, (*path, str(k))) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, (*path, str(i))) for i, v in enumerate(node))


def _subschemas(schema: dict[str, Any]) -> list[tuple[tuple[str, ...], Any]]:
    """A schema's direct subschemas with their relative paths, through schema keywords
    only (a property *named* "not" is never mistaken for one)."""
    found: list[tuple[tuple[str, ...], Any]] = []
    for keyword in _SCHEMAS:
        sub = schema.get(keyword)
        if isinstance(sub, list):  # prefixItems, anyOf, ...; also draft 7's `items: [...]`
            found.extend(((keyword, str(i)), item) for i, item in enumerate(sub))
        elif sub is not None:
            found.append(((keyword,), sub))
    for keyword in _MAP:
        sub = schema.get(keyword)
        if isinstance(sub, dict):
            found.extend(((keyword, name), item) for name, item in sub.items())
    return found


def _walk(schema: Any) -> Nodes:
    """Every object schema in the document with its path, the root first; iterative."""
    found: Nodes = []
    stack: list[tuple[tuple[str, ...], Any]] = [((), schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            found.append((path, node))
            subs = _subschemas(node)
            stack.extend(((*path, *rel), sub) for rel, sub in reversed(subs))
    return found


def _check_supported(nodes: Nodes) -> None:
    for path, node in nodes:
        for keyword, reason in UNSUPPORTED.items():
            if keyword in node:
                raise ValueError(f"{reason} (at {_pointer((*path, keyword))})")
        if len(node.get("allOf", ())) > 1:
            raise ValueError(f"`allOf` with more than one schema is not supported (at "
                             f"{_pointer((*path, 'allOf'))})")  # fmt: skip
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise ValueError(f"only local `$ref`s (\"#/...\") are supported, got {ref!r} "
                             f"(at {_pointer((*path, '$ref'))})")  # fmt: skip


# ----------------------------------------------------------------- $refs that never end
#
# A schema "can end" when some finite JSON value matches it. Each object schema needs
# clauses of options: one option of every clause must end. The keywords read are those that
# force a subschema into every instance ($ref, allOf, anyOf/oneOf, required properties, the
# first minItems items); anything else can be left out of an instance, so reading no more
# never refuses a schema that can end. Then, as for the productive symbols of a grammar,
# what can end is found from the leaves up, each clause met once (linear in the size).


def _check_refs_end(schema: Any, nodes: Nodes) -> None:
    """ValueError when `$ref`s lead only to each other, so no JSON value matches: at the
    root, or anywhere a `$ref` is (a property that could never be written)."""
    index = {id(node): i for i, (_, node) in enumerate(nodes)}
    ends = _which_end(schema, nodes, index)
    root_ends = schema is not False and (not isinstance(schema, dict) or ends[0])
    for (path, node), can_end in zip(nodes, ends, strict=True):
        if not can_end and isinstance(node.get("$ref"), str):
            raise ValueError(
                f"describes no JSON value: every way through its `$ref`s comes back to them, "
                f"with no case that ends (at {_pointer((*path, '$ref'))}); a recursive schema "
                "needs a way out, such as an `anyOf` branch without the `$ref`"
            )
    if not root_ends:
        raise ValueError("describes no JSON value: nothing can match it (at #)")


def _which_end(root: Any, nodes: Nodes, index: dict[int, int]) -> list[bool]:
    """For each object schema in `nodes`, whether some finite JSON value matches it."""
    waiting: list[list[tuple[int, int]]] = [[] for _ in nodes]  # node -> (needer, clause)
    left = [0] * len(nodes)  # clauses not yet met, per node
    for i, (_, node) in enumerate(nodes):
        for clause, options in enumerate(_requirements(root, node)):
            schemas = [o for o in options if o is not False]
            if not all(isinstance(o, dict) and id(o) in index for o in schemas):
                continue  # met at once: `true`, or something this check cannot follow
            left[i] += 1
            for option in schemas:
                waiting[index[id(option)]].append((i, clause))
    ends = [n == 0 for n in left]
    queue = [i for i, done in enumerate(ends) if done]
    met: set[tuple[int, int]] = set()
    while queue:
        for needer, clause in waiting[queue.pop()]:
            if (needer, clause) in met:
                continue
            met.add((needer, clause))
            left[needer] -= 1
            if left[needer] == 0:
                ends[needer] = True
                queue.append(needer)
    return ends


def _requirements(root: Any, node: dict[str, Any]) -> list[list[Any]]:
    """What `node` needs: clauses of options, one option of each must end (a schema, False
    that never ends, or True for one that does or that this check cannot follow)."""
    clauses: list[list[Any]] = []
    ref = node.get("$ref")
    if isinstance(ref, str):
        clauses.append([_resolve(root, ref)])
    for keyword in ("anyOf", "oneOf"):
        options = node.get(keyword)
        if isinstance(options, list):
            clauses.append([_schema_or_true(o) for o in options])
    all_of = node.get("allOf")
    if isinstance(all_of, list):
        clauses.extend([_schema_or_true(s)] for s in all_of)
    properties = node.get("properties")
    if isinstance(properties, dict):
        for name in node.get("required") or []:
            if isinstance(name, str) and name in properties:
                clauses.append([_schema_or_true(properties[name])])
    min_items = node.get("minItems")
    if isinstance(min_items, int) and min_items > 0:
        clauses.extend([_schema_or_true(s)] for s in _first_items(node, min_items))
    return clauses


def _first_items(node: dict[str, Any], count: int) -> list[Any]:
    """The schemas of an array's first `count` items (prefixItems, then items)."""
    prefix = node.get("prefixItems")
    items = node.get("items")
    if isinstance(items, list):  # draft 7: items as a list, additionalItems after it
        prefix, items = items, node.get("additionalItems")
    prefix = prefix if isinstance(prefix, list) else []
    found = prefix[:count]
    if len(prefix) < count and items is not None:
        found.append(items)
    return found


def _schema_or_true(value: Any) -> Any:
    """A subschema as an option: dicts and False as they are; anything else ends."""
    return value if isinstance(value, dict) or value is False else True


def _resolve(root: Any, ref: str) -> Any:
    """The schema a local `$ref` points at, found as xgrammar 0.2.8 finds it: the parts
    between slashes as written, empty ones skipped ("#/" is the root). True for a `$ref` it
    does not follow (an anchor: any value) or cannot find (a compile error follows)."""
    if ref != "#" and not ref.startswith("#/"):
        return True
    node = root
    for part in ref[1:].split("/"):
        if not part:
            continue
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return True
    return _schema_or_true(node)


def _pointer(path: Any) -> str:
    """A JSON Pointer ("#/properties/a") for an error message."""
    parts = [str(p).replace("~", "~0").replace("/", "~1") for p in path]
    return "#/" + "/".join(parts) if parts else "#"
