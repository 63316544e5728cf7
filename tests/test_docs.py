"""The technique catalog page is generated from the YAMLs and must be current, and the docs' code
runs."""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from helpers import make_stack, run_chunks, tokens

ROOT = Path(__file__).resolve().parents[1]


def test_technique_docs_are_current():
    got = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_technique_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert got.returncode == 0, got.stdout + got.stderr


def test_every_technique_has_a_docs_line_with_a_paper_and_an_example():
    page = (ROOT / "docs" / "techniques.md").read_text()
    for role in ("router", "compressor", "scheduler"):
        for path in (ROOT / "conf" / role).glob("*.yaml"):
            if path.stem == "none":
                continue
            line = next(x for x in page.splitlines() if x.startswith(f"| `{role}/{path.stem}` |"))
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))]
            assert len(cells[1]) > 40, (path, cells[1])  # a real sentence, not a truncated label
            assert cells[2], path
            assert path.stem == "chain" or cells[4].startswith("`python -m kvbench"), path


def blocks(path: Path, lang: str) -> list[str]:
    """The fenced ``lang`` code blocks of a markdown file, their indentation removed."""
    found = re.findall(rf"^( *)```{lang}\n(.*?)^\1```", path.read_text(), flags=re.M | re.S)
    out = []
    for indent, body in found:
        out.append(textwrap.dedent("\n".join(line[len(indent) :] for line in body.splitlines())))
    return out


def test_the_worked_example_runs_and_acts(tiny_93, monkeypatch):
    """docs/adding_a_technique.md's class and YAML, exactly as written, make a scheduler (through
    Hydra, as the CLI makes one) that runs on the tiny model, keeps the lowest key norms it says it
    keeps, and changes the output at budget 0.25."""
    doc = ROOT / "docs" / "adding_a_technique.md"
    (source,) = blocks(doc, "python")
    yaml_text = blocks(doc, "yaml")[0]
    module = types.ModuleType("kvbench.schedulers.key_norm")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(source, str(doc), "exec"), module.__dict__)
    made = instantiate(OmegaConf.create(yaml_text))
    assert type(made).__name__ == "KeyNormScheduler" and made.name == "key_norm" and made.low is True

    ids = tokens(64)
    sizes = [48, 8, 4, 1, 1, 1, 1]
    budget = dict(budget=0.25, sinks=2, window=4)
    full, _ = run_chunks(tiny_93, make_stack(tiny_93), ids, sizes)
    tight, _ = run_chunks(tiny_93, make_stack(tiny_93, scheduler=made, **budget), ids, sizes)
    assert not torch.allclose(full, tight, atol=1e-4)  # it acts

    # one prefill, one eviction: each head-row keeps its sinks, its window and the lowest key norms
    _, whole = run_chunks(tiny_93, make_stack(tiny_93), ids[:48], [48])
    _, kept = run_chunks(tiny_93, make_stack(tiny_93, scheduler=made, **budget), ids[:48], [48])
    for layer in range(len(kept.stores)):
        norms = whole.stores[layer].view().k.float().norm(dim=-1)  # (B, H, 48), position order
        view = kept.stores[layer].view()
        for h in range(norms.shape[1]):
            stored = set(view.pos[0, h][view.valid[0, h]].tolist())
            free = range(2, 44)  # neither a sink nor in the window
            assert set(range(2)) | set(range(44, 48)) <= stored and len(stored) == 12
            chosen = [norms[0, h, p] for p in free if p in stored]
            left = [norms[0, h, p] for p in free if p not in stored]
            assert max(chosen) <= min(left)


# ``python -m kvbench`` followed by its arguments, up to a comment, a closing backtick or the line's end
COMMAND = re.compile(r"python -m kvbench(?=[\s`]|$)([^#`;\n]*)")
WRITTEN_BY_THE_READER = "key_norm"  # the technique the worked example has the reader create


def example_commands() -> list[tuple[str, tuple[str, ...]]]:
    """Every ``python -m kvbench ...`` example of the configs' comments, README and docs: where it
    is written, and its overrides (``-m`` and ``--cfg job`` left out)."""
    found: dict[tuple[str, ...], str] = {}
    docs = sorted((ROOT / "docs").glob("*.md"))
    sources = [*sorted((ROOT / "conf").rglob("*.yaml")), ROOT / "README.md", *docs]
    for path in sources:
        # a shell line continued with a backslash is one command
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        for n, line in enumerate(text.splitlines(), 1):
            for match in COMMAND.finditer(line):
                words = shlex.split(match.group(1))
                if "..." in words or any(WRITTEN_BY_THE_READER in w or "<" in w for w in words):
                    continue  # the reader's own technique, or a pattern (``<role>=<name>``)
                args, skip = [], False
                for word in words:
                    if skip:
                        skip = False
                    elif word == "--cfg":
                        skip = True
                    elif word not in ("-m", "--multirun"):
                        args.append(word)
                found.setdefault(tuple(args), f"{path.relative_to(ROOT)}:{n}")
    return [(where, args) for args, where in found.items()]


def cells_of(args: tuple[str, ...]) -> list[list[str]]:
    """The cells a command names: a sweep's comma lists expanded (their product), Hydra's own
    ``hydra.*`` settings left to Hydra."""
    choices = []
    for arg in args:
        if arg.startswith("hydra."):
            continue
        key, _, value = arg.partition("=")
        values = value.split(",") if "," in value and not value.startswith("[") else [value]
        choices.append([f"{key}={v}" for v in values])
    return [list(cell) for cell in itertools.product(*choices)]


def test_every_example_command_composes():
    """Each ``python -m kvbench ...`` line in the configs' comments, README and docs composes (Hydra,
    no model): an example naming a missing option or key fails here, with where it is written."""
    from hydra import compose, initialize_config_dir

    from kvbench import config

    config.register()
    examples = example_commands()
    assert len(examples) > 50, examples
    failed = []
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        for where, args in examples:
            for cell in cells_of(args):
                try:
                    compose("config", overrides=cell)
                except Exception as error:  # every failure is reported below
                    command = "python -m kvbench " + " ".join(args)
                    failed.append(f"{where}: {command}: {type(error).__name__}: {error}")
    assert not failed, "\n".join(failed)
