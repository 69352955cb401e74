#!/usr/bin/env bash
# Create the venv and install fxdream into it. Reuses an installed (CUDA) torch when
# python3 already has one; otherwise pins the CPU wheel torch==2.13.0 so pip never
# pulls a multi-GB CUDA build onto a CPU machine.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  if "$python" -c "import torch" 2>/dev/null; then
    echo "bootstrap: reusing the torch of $python ($("$python" -c 'import torch; print(torch.__version__)'))"
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "bootstrap: installing torch==2.13.0 (CPU wheel)"
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
fi
"$venv/bin/python" -m pip install -q -e ".[test,plot]"
touch "$venv/.installed"
