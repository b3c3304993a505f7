#!/usr/bin/env bash
# tools/torch_tier.sh VERSION [pytest args]: the unit tier (-m "not multiprocess") under torch VERSION, in a virtual
# environment of its own that sees this machine's other packages (hybridpar installed with `pip install -e
# ".[test]"`): README's promise of which torch versions work is what this ran. The environment is made once, under
# $TORCH_TIER_DIR (default /tmp/hybridpar-torch-VERSION), with pip's default wheel of that torch (a CUDA wheel runs on
# CPU too). TORCH_TIER_PIP: other pins for that environment, e.g. "torchao==0.9.0" beside torch 2.6 (setup.py's
# torchao==0.18.0 needs torch >= 2.11).
set -euo pipefail
v=${1:?usage: tools/torch_tier.sh TORCH_VERSION [pytest args], e.g. tools/torch_tier.sh 2.11.0}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${TORCH_TIER_DIR:-/tmp/hybridpar-torch-$v}
has() { "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$v')" 2>/dev/null; }
if [ ! -x "$venv/bin/python" ] || ! has; then
  python3 -m venv --system-site-packages "$venv"
  "$venv/bin/python" -m pip install --quiet "torch==$v"
fi
if [ -n "${TORCH_TIER_PIP:-}" ]; then
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet --no-deps $TORCH_TIER_PIP
fi
cd "$root"
"$venv/bin/python" -c "import torch; print('tools/torch_tier.sh: torch', torch.__version__)"
exec "$venv/bin/python" -m pytest -q -m "not multiprocess" -p no:cacheprovider "$@"
