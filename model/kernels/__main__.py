"""`python -m model.kernels`: build recur's CPU kernels now (make install and the image run
it), so that no server builds them on its first load. A machine that cannot build them says
why and still exits 0: int4 weights then use torch's kernel (model/kernels/__init__.py)."""

import logging
import sys

from . import directory, int4_mm, name

logging.basicConfig(level=logging.INFO, format="%(message)s")
if int4_mm() is None:
    print("recur's kernels: not built here; int4 weights will use torch's bfloat16 kernel", file=sys.stderr)
else:
    print(f"recur's kernels: {directory() / name()}.so")
