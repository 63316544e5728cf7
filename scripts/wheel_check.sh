#!/usr/bin/env bash
# A non-editable install runs (issue 12): builds kvbench's wheel, installs it with --no-deps into a
# fresh environment, and from a directory outside the checkout composes a config, plans a sweep
# (dry run) and runs one tiny-model cell, then renders its report.
#
#   scripts/wheel_check.sh [PYTHON]     # PYTHON: the venv with kvbench's dependencies (.venv/bin/python)
#
# The fresh environment sees the venv's site-packages through a .pth line, for the dependencies
# only: a directory named in a .pth file is added to the path without running the .pth files inside
# it, so the editable install's finder never loads and kvbench can only come from the wheel.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${1:-$ROOT/.venv/bin/python}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvbench-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
say() { echo "wheel_check: $*"; }
started=$SECONDS

# The build runs on a copy: it writes build/ and *.egg-info beside the sources.
mkdir "$WORK/src" "$WORK/run"
tar -C "$ROOT" --exclude='*.egg-info' --exclude=__pycache__ -cf - pyproject.toml README.md src conf |
    tar -C "$WORK/src" -xf -
if ! "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1; then
    cat "$WORK/build.log"
    say "FAILED: the wheel did not build"
    exit 1
fi
WHEEL="$(ls "$WORK"/dist/kvbench-*.whl)"
say "built $(basename "$WHEEL")"
# A folder of src/kvbench or conf/ left out of pyproject's packages list: its Python files are
# not shipped, and setuptools ships its YAML files only as a deprecated data directory.
unlisted="$(grep -o "Package '[^']*' is absent from the \`packages\` configuration" "$WORK/build.log" | cut -d"'" -f2 | sort -u || true)"
if [ -n "$unlisted" ]; then
    say "FAILED: add these to packages in pyproject.toml ([tool.setuptools]): $(echo $unlisted)"
    exit 1
fi

# Every YAML under conf/ ships as kvbench/conf/...
"$PY" - "$WHEEL" "$ROOT/conf" <<'EOF'
import pathlib
import sys
import zipfile

names = set(zipfile.ZipFile(sys.argv[1]).namelist())
conf = pathlib.Path(sys.argv[2])
yamls = sorted(p.relative_to(conf).as_posix() for p in conf.rglob("*.yaml"))
missing = [y for y in yamls if f"kvbench/conf/{y}" not in names]
if missing:
    folders = sorted({".".join(["kvbench.conf", *y.split("/")[:-1]]) for y in missing})
    sys.exit(
        f"wheel_check: FAILED: {len(missing)} YAML files of conf/ are not in the wheel ({', '.join(missing[:5])}"
        f"{', ...' if len(missing) > 5 else ''}); add {', '.join(folders)} to packages in pyproject.toml"
    )
print(f"wheel_check: the wheel holds all {len(yamls)} YAML files of conf/")
EOF

"$PY" -m venv --without-pip "$WORK/env"
ENV_PY="$WORK/env/bin/python"
purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
SITE="$("$ENV_PY" -c "$purelib")"
"$PY" -c "$purelib" >"$SITE/kvbench-dependencies.pth"
"$PY" -m pip install -q --no-deps --no-index --target "$SITE" "$WHEEL"

# -I: no PYTHONPATH, no user site, not the current directory; run from outside the checkout.
cd "$WORK/run"
export KVBENCH_CACHE="$WORK/cache" KVBENCH_HYDRA_DIR="$WORK/hydra" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export WANDB_MODE=offline
run() { "$ENV_PY" -I "$@"; }
run - "$SITE" <<'EOF'
import sys
from pathlib import Path

import hydra_plugins.kvbench_plugins as plugins
import kvbench
from kvbench.paths import CONF_DIR

site = Path(sys.argv[1]).resolve()
print(f"wheel_check: kvbench.__file__ = {kvbench.__file__}")
print(f"wheel_check: CONF_DIR = {CONF_DIR}")
for what, path in (("kvbench", kvbench.__file__), ("its plugins", plugins.__file__), ("conf", CONF_DIR)):
    if site not in Path(path).resolve().parents:
        sys.exit(f"wheel_check: FAILED: {what} comes from {path}, not from the wheel's install in {site}")
EOF

TINY=(model=tiny_random dataset=pydoc dataset.prefill=48 dataset.chunk=8 dataset.chunks_per_window=2
    dataset.windows=2 dataset.decode_steps=2 window=8 sinks=2 "results_dir=$WORK/results")

say "compose: python -m kvbench --cfg job ${TINY[*]}"
run -m kvbench --cfg job "${TINY[@]}" >"$WORK/job.yaml"
grep -q "name: tiny_random" "$WORK/job.yaml" || { cat "$WORK/job.yaml"; say "FAILED: --cfg job"; exit 1; }

say "plan: python -m kvbench -m hydra.sweeper.dry_run=true scheduler=none,h2o (tiny model)"
run -m kvbench -m hydra.sweeper.dry_run=true "${TINY[@]}" scheduler=none,h2o name=plan >"$WORK/plan.txt" 2>&1 ||
    { cat "$WORK/plan.txt"; say "FAILED: the dry-run plan"; exit 1; }
grep -q "2 cells" "$WORK/plan.txt" || { cat "$WORK/plan.txt"; say "FAILED: the plan has not 2 cells"; exit 1; }

say "one cell: python -m kvbench scheduler=h2o name=cell (tiny model)"
run -m kvbench "${TINY[@]}" scheduler=h2o name=cell >"$WORK/cell.txt" 2>&1 ||
    { cat "$WORK/cell.txt"; say "FAILED: the tiny cell"; exit 1; }
run -m kvbench.report "$WORK/results/cell" >"$WORK/report.md" ||
    { cat "$WORK/report.md"; say "FAILED: the report"; exit 1; }
grep -q "h2o" "$WORK/report.md" || { cat "$WORK/report.md"; say "FAILED: the report has no h2o row"; exit 1; }
say "ok: the wheel installs and runs outside the checkout ($((SECONDS - started)) s)"
