#!/usr/bin/env bash
# Installs what benchmarks/gpu/bench.py needs beside the CUDA torch already on the GPU machine, and never
# another torch: rlft's dependencies (read from pyproject.toml; bench.py imports rlft itself from this
# checkout, so nothing is built), then trl==1.16.0 without its dependencies (rlft's cover them). From a local
# wheels folder when there is one (an offline machine), else from the package registry.
#
#   bash benchmarks/gpu/setup.sh                                  # offline from ./wheels if it exists
#   WHEELS=/data/wheels PYTHON=python3 bash benchmarks/gpu/setup.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-python}"
wheels="${WHEELS:-$root/wheels}"

if ! torch_version="$("$python" -c 'import torch; print(torch.__version__)')"; then
    echo "setup.sh: $python has no torch; install the CUDA build of torch for this machine first" >&2
    exit 1
fi
pin="$(mktemp)"
needs="$(mktemp)"
trap 'rm -f "$pin" "$needs"' EXIT
echo "torch==$torch_version" > "$pin"  # a constraint: pip keeps this exact build or stops, never swaps it
"$python" - "$root/pyproject.toml" > "$needs" <<'PY'
import re
import sys

text = open(sys.argv[1]).read()
try:
    import tomllib  # Python 3.11+

    needs = tomllib.loads(text)["project"]["dependencies"]
except ModuleNotFoundError:  # 3.10: the list holds one quoted requirement a line
    block = text.split("\ndependencies = [", 1)[1].split("]", 1)[0]
    needs = re.findall(r'^\s*"([^"]+)"', block, re.M)
print("\n".join(needs))
PY

options=(--constraint "$pin")
if [ -d "$wheels" ]; then
    options+=(--no-index --find-links "$wheels")  # offline: nothing from the registry
    echo "setup.sh: installing from $wheels only"
else
    echo "setup.sh: no $wheels folder, installing from the package registry"
fi

if ! "$python" -m pip install "${options[@]}" --requirement "$needs"; then
    echo "setup.sh: add the wheels pip could not find to $wheels (see benchmarks/gpu/README.md)" >&2
    exit 1
fi
"$python" -m pip install "${options[@]}" --no-deps "trl==1.16.0"

"$python" - <<'PY'
import torch
import transformers
import trl

gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU visible"
print(f"ready: torch {torch.__version__} (CUDA {torch.version.cuda}, {gpu}), "
      f"transformers {transformers.__version__}, trl {trl.__version__}")
PY
