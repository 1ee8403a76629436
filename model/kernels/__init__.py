"""recur's own CPU kernels, built from their C++ source on this machine and loaded into torch's
operator registry (`torch.ops.recur_kernels`).

One kernel: `int4_mm` (int4_cpu.cpp, int4_body.inc), the product of fp32 rows by an int4
weight in torch's packed CPU layout with its scales exact (fp32, or fp16 as a Q4_1 file holds
them): the dequantized weight's product up to the order of fp32's additions, 1.2-1.6x faster
than torch's kernel (docs/BENCHMARKS.md, "recur's int4 kernel"). torch's own int4 kernel
(`_weight_int4pack_mm_for_cpu`) takes its activations, scales and output in bfloat16, and
those roundings, not the file's 4 bits, are what kept the int4 path's greedy tokens from
fp32's; no library on the package index serves the product in fp32 on x86 (torchao's wheels
carry no CPU kernels, Intel's extension is retired), so recur carries its own, about 250
lines of C++ (model/int4.py says where it is used).

Built once per source and torch version, with torch's extension builder (a C++ compiler and
ninja), into `build/` beside this file or, where that is not writable, the user's cache
(`RECUR_KERNELS_DIR` overrides both), and loaded from whichever holds it (the image's is
read-only to its user); `make install` and the image build it ahead
(`python -m model.kernels`). The library picks its AVX-512 or AVX2 build at run time;
a CPU with neither, or a machine that cannot build, serves torch's kernel instead
(`int4_mm()` is None) and says so in the log.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_cpu.cpp")
SOURCES = (SOURCE, SOURCE.with_name("int4_body.inc"))  # (the second is included twice: one per ISA)
# at::parallel_for is OpenMP in torch's headers; the library links torch's own libgomp (the
# runtime already loaded under that name), so its threads are torch's threads
CFLAGS = ["-O3", "-fopenmp"]
ISA = {"avx512": torch.cpu._is_avx512_supported(), "avx2": torch.cpu._is_avx2_supported()}


def name() -> str:
    """The library's name: the source's and torch's version in it, so a change rebuilds."""
    digest = hashlib.sha256(
        b"".join(p.read_bytes() for p in SOURCES) + f"{torch.__version__} {CFLAGS}".encode()
    ).hexdigest()[:12]
    return f"recur_kernels_{digest}"


PACKAGE_DIR = Path(__file__).with_name("build")  # where make install and the image build it


def directories() -> list[Path]:
    """Where the library may be, in order: RECUR_KERNELS_DIR alone where set; else build/
    beside this file (make install's, the image's: read-only to a server's user there), then
    the user's cache."""
    if env := os.environ.get("RECUR_KERNELS_DIR"):
        return [Path(env)]
    return [PACKAGE_DIR, Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "recur" / "kernels"]


def directory() -> Path:
    """Where the library is, or is to be built: the first of `directories` that holds this
    build, else the first writable one."""
    dirs = directories()
    for d in dirs:
        if (d / f"{name()}.so").exists():
            return d
    for d in dirs:
        if os.access(d if d.exists() else d.parent, os.W_OK):
            return d
    return dirs[-1]


def build() -> Path:
    """Load the library, compiling it first where this source and torch have no build yet."""
    where = directory()
    library = where / f"{name()}.so"
    if library.exists():
        torch.ops.load_library(str(library))
        return library
    from torch.utils import cpp_extension

    try:  # the `ninja` wheel's binary, which the extension builder looks for on PATH
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass
    where.mkdir(parents=True, exist_ok=True)
    for stale in where.glob("recur_kernels_*.so"):  # (an earlier source's or torch's build)
        if stale.name != library.name:
            stale.unlink(missing_ok=True)
    cpp_extension.load(
        name(),
        [str(SOURCE)],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(where),
        is_python_module=False,
        verbose=False,
    )
    return library


@functools.cache
def int4_mm():
    """`torch.ops.recur_kernels.int4_mm` (x, packed, scales[, avx512]) -> y, or None where this
    CPU has no AVX2 or the library cannot be built here (logged once)."""
    if not (ISA["avx512"] or ISA["avx2"]):
        log.warning("this CPU has neither AVX-512 nor AVX2: int4 weights use torch's bfloat16 kernel")
        return None
    try:
        build()
    except Exception as e:  # no compiler, no ninja, a read-only disk: torch's kernel serves
        log.warning("recur's int4 kernel did not build (%s): int4 weights use torch's bfloat16 kernel", e)
        return None
    torch.library.register_fake("recur_kernels::int4_mm")(_int4_mm_shape)
    return torch.ops.recur_kernels.int4_mm.default


def _int4_mm_shape(x, packed, scales, avx512=-1):
    """The product's output for a traced call (torch.compile): (M, N') fp32."""
    return x.new_empty(x.shape[0], scales.shape[0] * scales.shape[3])
