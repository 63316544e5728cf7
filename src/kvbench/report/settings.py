"""The settings that tell a table's rows apart: the identity keys whose values differ between them.

A record's ``identity`` is its resolved config minus what cannot change a number (logging, launcher,
output paths); two cells of one model and dataset differ somewhere in it. A table's Settings column
shows, per row, the keys on which its rows disagree, as ``sinks=0`` (the leaf's name, or its dotted
path where two such keys share a leaf name). A pure function of the records, like the tables.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from kvbench.report.records import _get

_ROLES = ("router", "compressor", "scheduler")
# Left out: seeds (rows repeated over seeds are merged into one row, n shows seeds×examples) and
# sha256 digests (the footer shows the data's; a digest follows from the keys that produced it).
_SKIP_LEAVES = frozenset({"seed", "sha256"})
# A technique's name and class: the role columns already show them.
_SHOWN_IN_ROLES = frozenset({"name", "_target_"})

Key = tuple[str, tuple[str, ...]]  # (the technique the knob belongs to, or "", the dotted path)


def _leaves(node: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every leaf of ``node`` with its path; lists of mappings (a chain's stages) by index."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, str(key)))
    elif isinstance(node, list) and any(isinstance(v, dict) for v in node):
        for i, value in enumerate(node):
            yield from _leaves(value, (*path, str(i)))
    else:
        yield path, node


def _technique(node: Any) -> str:
    """A role's technique as the role columns show it: its name, with a chain's stage names."""
    if not isinstance(node, dict):
        return str(node)
    stages = node.get("stages") or []
    names = [str(s.get("name")) if isinstance(s, dict) else str(s) for s in stages]
    return f"{node.get('name')}[{','.join(names)}]" if names else str(node.get("name"))


def _settings_of(record: dict) -> dict[Key, Any]:
    """The record's identity as leaves, keyed by the path a user types: ``sinks``, ``compressor.bits``.

    ``stack.`` and the stack-wide ``budget.`` group are left out of the path. A technique's knobs are
    keyed by their technique too, so knobs of two different techniques never count as differing: the
    role columns tell those rows apart.
    """
    ident = record.get("identity")
    if not isinstance(ident, dict):
        return {}
    out: dict[Key, Any] = {}
    for path, value in _leaves(ident, ()):
        if path[-1] in _SKIP_LEAVES:
            continue
        owner = ""
        if path[0] == "stack" and len(path) > 2 and path[1] == "budget":
            path = path[2:]
        elif path[0] == "stack" and len(path) > 2 and path[1] in _ROLES:
            if path[2:] in {(k,) for k in _SHOWN_IN_ROLES}:
                continue
            owner = f"{path[1]}/{_technique(_get(ident, 'stack', path[1]))}"
            path = path[1:]
        out[(owner, path)] = value
    return out


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _names(keys: Sequence[Key]) -> dict[Key, str]:
    """The shown name of each key: its leaf, or its dotted path where two paths share the leaf."""
    paths = {path for _, path in keys}
    leaves = [path[-1] for path in paths]
    return {key: key[1][-1] if leaves.count(key[1][-1]) == 1 else ".".join(key[1]) for key in keys}


def row_settings(records: Sequence[dict], shown: Collection[str] = ()) -> list[str] | None:
    """Each row's settings among those that differ between ``records``; None when none differ.

    A key differs when the rows that have it hold two values or more (a row without it, e.g. the
    full cache without a budget, shows nothing for it).

    Args:
        records: A table's rows, in its order.
        shown: Dotted paths the table already shows in a column of its own (e.g. ``budget``).

    Returns:
        One string per record, ``sinks=0, window=32`` (empty for a row with none of the keys), or
        None when no key differs.
    """
    settings = [_settings_of(r) for r in records]
    values: dict[Key, set[str]] = {}
    for row in settings:
        for key, value in row.items():
            values.setdefault(key, set()).add(_text(value))
    differ = [k for k, v in values.items() if len(v) > 1 and ".".join(k[1]) not in shown]
    if not differ:
        return None
    names = _names(differ)
    return [", ".join(f"{names[k]}={_text(row[k])}" for k in differ if k in row) for row in settings]
