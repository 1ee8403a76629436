"""Leaving the cores' OpenMP threads to the engine.

torch's CPU kernels run their parallel loops on OpenMP, and an OpenMP runtime keeps a pool of
worker threads for every thread that has started a parallel region. GNU OpenMP (libgomp, which
torch's Linux wheels carry) lets its threads spin at the end of each region, waiting for the
next one, only while all the pools' threads together fit the CPUs; past that it throttles the
spin to almost nothing, and every thread sleeps on a futex at every region's end and has to
be woken for the next. A decode step is some 1,500 small operations, most of them a region:
measured on the 2-core machine with 2 threads, SmolLM2's 16-row int4 step ran at 231-242
tokens/s in the thread that loaded the model and at 116-130 (55,000 sleeps in 64 steps) in
another thread, while the loading thread's idle pool of one worker was alive.

The server loads the model on its main thread and steps it on the engine thread, and its
loader and encoder threads run torch operations on states: so each of them held a pool, and the
engine's step ran as in the second case (2,650 sleeps a second). `step_aside` makes a thread
give its pool back (`omp_pause_resource_all`, OpenMP 5.0) and run its later parallel regions
on itself alone (`omp_set_num_threads(1)`, and MKL's `MKL_Set_Num_Threads_Local(1)`, whose
products otherwise start a pool again: for that thread only), so that the engine's pool is
the only one. Where the process has no OpenMP runtime that offers these, nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch

_PAUSE_SOFT = 1  # omp_pause_soft: free the thread pool; it is started again when needed
_RUNTIMES = ("libgomp", "libiomp", "libomp")  # GNU's, Intel's, LLVM's


def _loaded(prefixes: tuple[str, ...], symbol: str) -> ctypes.CDLL | None:
    """The first library this process has loaded whose file name starts with one of
    `prefixes` and that exports `symbol`, or None."""
    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
        for path in sorted(paths):
            if os.path.basename(path).startswith(prefixes):
                with contextlib.suppress(OSError, AttributeError):
                    lib = ctypes.CDLL(path)
                    getattr(lib, symbol).argtypes = [ctypes.c_int]
                    return lib
    return None


@functools.cache
def runtime() -> tuple[ctypes.CDLL | None, ctypes.CDLL | None]:
    """The OpenMP runtime this process has loaded (torch's), and the library that holds
    MKL, whose products keep a thread count of their own; either None where absent."""
    omp = _loaded(_RUNTIMES, "omp_pause_resource_all")
    if omp is not None:
        omp.omp_set_num_threads.argtypes = [ctypes.c_int]
    # (MKL's C name: the lower-case one is its Fortran entry, which takes a pointer)
    return omp, _loaded(("libtorch_cpu", "libmkl"), "MKL_Set_Num_Threads_Local")


def step_aside() -> bool:
    """The calling thread gives back its OpenMP thread pool and runs its later parallel
    regions alone (torch's loops and MKL's products), leaving the cores to the engine
    thread's pool; whether it could."""
    omp, mkl = runtime()
    if omp is None:
        return False
    torch.get_num_threads()  # (torch sets a thread's OpenMP threads at its first use: before ours)
    omp.omp_set_num_threads(1)
    if mkl is not None:
        mkl.MKL_Set_Num_Threads_Local(1)
    return omp.omp_pause_resource_all(_PAUSE_SOFT) == 0
