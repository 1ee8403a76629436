#!/usr/bin/env bash
# One GPU, under 5 minutes: correctness on the device, decode throughput, and the
# stateful-decode speedup sweep. Run from the repo root on a GPU host with the project
# installed against a CUDA torch build, e.g.
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cu128 && bash bench/gpu_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONUNBUFFERED=1
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$PY" bench/gpu_smoke.py
(cd bench && "$PY" model_step.py --device cuda --steps 100)
