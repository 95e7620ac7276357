#!/usr/bin/env bash
# The one-shot GPU run: install jaxmoe from a wheel folder (no network), then one process
# (oneshot.py) checks the GPU, compares 5 steps with the CPU, and measures jaxmoe and PyTorch.
#
#   bash run.sh --wheels DIR [--dry-run] [--out FILE] [--site PRIVATE_DIR]
#
# DIR is what fetch_wheels.py wrote (default: this script's own folder when it holds a
# manifest.json, as in a fetched bundle). Every wheel in it is installed with --no-index and
# --no-deps into PRIVATE_DIR (default: a fresh temporary folder), which goes first on
# PYTHONPATH: the image's own packages are neither changed nor shadowed by anything else.
# PYTHON picks the interpreter (default python3). Exit 0 when everything ran (and, on the
# GPU, the GPU's losses matched the CPU's).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WHEELS="" OUT="gpu_oneshot.json" SITE="" DRY=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --site) SITE="$2"; shift 2 ;;
    --dry-run) DRY=(--dry-run); shift ;;
    *) echo "run.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
if [ -z "$WHEELS" ] && [ -f "$HERE/manifest.json" ]; then WHEELS="$HERE"; fi
if [ -z "$WHEELS" ] || [ ! -f "$WHEELS/manifest.json" ]; then
  echo "run.sh: no wheel folder: pass --wheels DIR (what fetch_wheels.py wrote)" >&2
  exit 2
fi
PY="${PYTHON:-python3}"
SITE="${SITE:-$(mktemp -d "${TMPDIR:-/tmp}/jaxmoe-site.XXXXXX")}"
shopt -s nullglob
FILES=("$WHEELS"/*.whl)
if [ ${#FILES[@]} -eq 0 ]; then echo "run.sh: no wheels in $WHEELS" >&2; exit 2; fi
echo "run.sh: installing ${#FILES[@]} wheels from $WHEELS into $SITE"
"$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" --target "$SITE" \
  --upgrade --disable-pip-version-check --no-compile "${FILES[@]}"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"
ONESHOT="$HERE/oneshot.py"
exec "$PY" "$ONESHOT" --out "$OUT" "${DRY[@]}"
