"""Calibration text: English prose that ships with Python and is disjoint from the evaluated corpus.

Calibrated techniques (``lora``'s bases, ``duo_attention``'s gates, ``rankkv``'s layer ranks) are
fitted on text the benchmark never scores. The perplexity corpus is ``pydoc_data.topics`` (the
language reference); calibration uses the docstrings of a fixed, sorted list of standard-library
modules instead: each module's own docstring, then the docstrings (200 characters or more) of the
public classes and functions it defines, by name. As a guard, any docstring sharing a 64-character
substring with ``pydoc_data.topics`` is dropped, so the two texts are disjoint by construction.

The text depends on the Python version; :func:`describe` records the version and the text's sha256,
and calibration artifacts are keyed by that description.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import platform
import sysconfig
import warnings
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError

NAME = "stdlib_docstrings"
MODULES = (
    "argparse",
    "cmd",
    "collections",
    "configparser",
    "copy",
    "csv",
    "difflib",
    "doctest",
    "ftplib",
    "getopt",
    "heapq",
    "http.client",
    "http.server",
    "inspect",
    "io",
    "itertools",
    "json",
    "mimetypes",
    "optparse",
    "os",
    "pickle",
    "pprint",
    "random",
    "re",
    "sched",
    "shelve",
    "smtplib",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tempfile",
    "timeit",
    "tokenize",
    "trace",
    "typing",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
)
MIN_MEMBER_DOC = 200  # characters: shorter member docstrings are signatures more than prose
GUARD_CHARS = 64  # a docstring sharing this many characters with pydoc topics is dropped
JOINER = "\n\n"


@functools.cache
def calibration_text() -> str:
    """The calibration text: stdlib docstrings in a fixed order (about 230k characters on 3.11)."""
    evaluated = _evaluated_grams()
    parts = [doc for doc in _docstrings() if not _shares_text(doc, evaluated)]
    return JOINER.join(parts)


def describe() -> dict[str, Any]:
    """What the calibration text is, for keys and records: name, Python version, size, sha256."""
    text = calibration_text()
    return {
        "name": NAME,
        "python": platform.python_version(),
        "chars": len(text),
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }


def calibration_ids(lm, tokens: int, offset: int = 0) -> list[int]:
    """Token ids ``[offset, offset + tokens)`` of the calibration text under ``lm``'s codec.

    Args:
        lm: a :class:`kvbench.models.LoadedModel` (its ``codec`` encodes).
        tokens: how many ids to return (positive).
        offset: the first id's index in the encoded text.

    Raises:
        ConfigError: ``tokens`` is not positive, or the text is shorter than ``offset + tokens``.
    """
    if tokens < 1 or offset < 0:
        raise ConfigError(f"calibration tokens={tokens}, offset={offset}: need tokens >= 1 and offset >= 0")
    ids = _encoded(lm.codec)
    if offset + tokens > len(ids):
        raise ConfigError(
            f"calibration text: {tokens} tokens from offset {offset} asked, but it is {len(ids)} tokens long "
            f"under this model's tokenizer; ask for at most {len(ids) - offset}"
        )
    return list(ids[offset : offset + tokens])


@functools.lru_cache(maxsize=4)
def _encoded(codec) -> tuple[int, ...]:
    return tuple(codec.encode(calibration_text()))


def _docstrings() -> list[str]:
    """Module docstrings, each followed by its long member docstrings; missing modules skipped."""
    docs: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. typing.io's deprecation, touched by attribute lookups
        for name in sorted(MODULES):
            try:
                module = _stdlib_module(name)
            except ImportError:
                continue
            if module.__doc__:
                docs.append(inspect.cleandoc(module.__doc__))
            docs.extend(_member_docs(module))
    return docs


def _stdlib_module(name: str) -> Any:
    """Standard-library module ``name``, imported. A file or folder of that name elsewhere on
    ``sys.path`` (a script's own folder comes first) shadows it, and the text, the bases fitted on
    it and every score after them would change with the folder a run starts from: refused, in one
    line that names it."""
    module = importlib.import_module(name)
    path = getattr(module, "__file__", None)  # None: built into the interpreter
    if path is not None:
        stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
        where = Path(path).resolve()
        if not where.is_relative_to(stdlib) or {"site-packages", "dist-packages"} & set(where.parts):
            raise ConfigError(
                f"calibration text: module {name!r} is {where}, not the standard library's (under {stdlib}): "
                f"a file or folder of that name on sys.path shadows it; rename it, or run from another folder"
            )
    return module


def _member_docs(module) -> list[str]:
    out = []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue  # imported from elsewhere
        doc = obj.__doc__
        if isinstance(doc, str) and len(doc) >= MIN_MEMBER_DOC:
            out.append(inspect.cleandoc(doc))
    return out


def _evaluated_grams() -> frozenset[str]:
    """Every ``GUARD_CHARS``-character substring of the evaluated corpus (pydoc topics)."""
    from pydoc_data.topics import topics

    text = JOINER.join(topics[k] for k in sorted(topics))
    return frozenset(text[i : i + GUARD_CHARS] for i in range(len(text) - GUARD_CHARS + 1))


def _shares_text(doc: str, grams: frozenset[str]) -> bool:
    return any(doc[i : i + GUARD_CHARS] in grams for i in range(len(doc) - GUARD_CHARS + 1))
