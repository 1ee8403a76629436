"""The peer a user would pick instead of recur for the shipped assistant: llama.cpp on the same
GGUF file (SmolLM2-135M-Instruct, Q4_1), measured side by side with recur in one run, with
the same number of threads (`--threads`, default every core). `make bench-peers` runs it;
it is not part of `make test` (the builds take minutes).

The builds, into .bench-peers/ (ignored by git), from the package index's source
distribution of llama-cpp-python (`LLAMA_CPP_PYTHON`): llama.cpp's own server,
`llama-server`, and its shared libraries, compiled once with CMake from the llama.cpp
sources the sdist vendors; and the Python bindings (`pip install --target`, the same sdist
without its own compile of llama.cpp), which load those libraries.

Three figures, each against issue 42's target (recur's best path over llama.cpp's), recur
with fp32, int8 and int4 weights (model/int8.py, model/int4.py):
  * batch-1 decode tokens/s, in-process: llama-cpp-python's `Llama.eval` one token at a time
    against recur's decode step (`LanguageModel.next_logits`, pick, forward; as the engine
    runs it, eager), each after the same 600-character prompt. Target: >= 1.0x.
  * prompt processing tokens/s, in-process: a 512-token prompt (`PROMPT_TOKENS`, the same
    ids: the file's vocabulary) into a fresh state. llama.cpp's `Llama.eval` in one batch
    of 512 (n_batch = n_ubatch = 512: what `llama-bench -p 512 -n 0` times), with flash
    attention and without, the faster kept; recur's `prefill` of `segment_len` chunks
    without log-probs, as the engine prefills a completion's prompt. Target: >= 1.0x.
  * aggregate tokens/s of 16 concurrent streams over HTTP: `llama-server` with 16 parallel
    slots (continuous batching, `-np 16 -c 16384`) against `recur serve` (sessions in a real
    Redis, the OpenAI completion route), 16 clients at once, the same prompts, greedy, 128
    tokens each with `ignore_eos`. Target: >= 1.5x.
Batch 1 and prompt processing alternate the sides in rounds (each side's best: a shared
machine's load then falls on all alike); the servers run one after the other.

`--write` puts the section "## 11. The assistant against llama.cpp" into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx
import torch
from harness import Redis, Server, arguments, publish, started

import model
from app.embedded_redis import free_port
from model.corpus import load_split

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".bench-peers"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SECTION = "## 11. The assistant against llama.cpp"
STREAMS, NEW_TOKENS = 16, 128
PROMPT_TOKENS = 512  # prompt processing: llama-bench's pp512
PRECISIONS = ("fp32", "int8", "int4")


# -- the builds ----------------------------------------------------------------------------
def build_llama_cpp() -> Path:
    """llama.cpp from the sources the sdist vendors, compiled once with CMake into
    .bench-peers/server: `llama-server`, `llama-bench`, `llama-quantize` (bench/kquants.py's
    K-quant file), and the shared libraries they link (libllama, libggml), which the Python
    bindings load too."""
    build = PEERS / "server"
    bin_dir, stamp = build / "bin", build / "recur-cmake-options"
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        *isa_options(),
    ]
    built = all(
        (bin_dir / f).is_file() for f in ("llama-server", "llama-bench", "llama-quantize", "libllama.so")
    )
    if built and stamp.is_file() and stamp.read_text() == " ".join(flags):
        return bin_dir
    vendored = next(sdist().parent.glob("llama_cpp_python-*/vendor/llama.cpp"))
    run(["cmake", "-S", str(vendored), "-B", str(build), "-G", "Ninja", *flags], "cmake")
    run(
        [
            "cmake",
            "--build",
            str(build),
            "--target",
            "llama-server",
            "llama-bench",
            "llama-quantize",
            "-j",
            str(os.cpu_count() or 1),
        ],
        "llama-server, llama-bench, llama-quantize and libllama",
    )
    stamp.write_text(" ".join(flags))  # built with these options (another CPU: built again)
    return bin_dir


# ggml's options for the instruction sets it has kernels for, by the name /proc/cpuinfo gives them
GGML_ISA = {
    "sse4_2": "GGML_SSE42",
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "avx_vnni": "GGML_AVX_VNNI",
    "bmi2": "GGML_BMI2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}


def isa_options() -> list[str]:
    """Every instruction set this CPU reports, but AMX: ggml's default (`GGML_NATIVE`,
    -march=native) compiles its AMX kernels wherever the CPU lists the AMX flags, and a
    virtual machine can list them without its kernel granting the tile state (so on this
    machine: SIGILL at the first `tileloadd`). The AVX-512 and VNNI kernels serve instead."""
    flags: set[str] = set()
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
    return ["-DGGML_NATIVE=OFF"] + [
        f"-D{opt}={'ON' if isa in flags else 'OFF'}" for isa, opt in GGML_ISA.items()
    ]


def build_python() -> Path:
    """llama-cpp-python's Python package from the same sdist, without compiling llama.cpp a
    second time (`LLAMA_BUILD=OFF`): it loads `build_llama_cpp`'s libllama
    (`LLAMA_CPP_LIB_PATH`)."""
    target = PEERS / "python"
    if not (target / "llama_cpp").is_dir():
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", str(target), str(sdist())]
        run(cmd, "llama-cpp-python (its Python package)", {"CMAKE_ARGS": "-DLLAMA_BUILD=OFF"})
    # only build_llama_cpp's libraries: a copy of libggml that pip put beside the package (a
    # wheel it cached, built for another CPU) would be loaded in their place
    shutil.rmtree(target / "llama_cpp" / "lib", ignore_errors=True)
    return target


def sdist() -> Path:
    """The package index's source distribution of `LLAMA_CPP_PYTHON`, downloaded and unpacked."""
    src = PEERS / "src"
    found = next(src.glob("llama_cpp_python-*.tar.gz"), None)
    if found is None:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(src),
        ]
        run([*cmd, LLAMA_CPP_PYTHON], "the sdist")
        found = next(src.glob("llama_cpp_python-*.tar.gz"))
    if not any(src.glob("llama_cpp_python-*/vendor/llama.cpp")):
        with tarfile.open(found) as tar:
            tar.extractall(src, filter="data")
    return found


def run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> None:
    print(f"building {what} ...", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, **env} if env else None)
    print(f"built {what} in {time.perf_counter() - t0:.0f} s", flush=True)


# -- batch-1 decode, in-process ----------------------------------------------------------------
def prompt_text() -> str:
    return load_split("shakespeare", "test")[0][1][10_000:10_600]


def llama_cpp(gguf: Path, threads: int, **options):
    """llama-cpp-python's `Llama` on `gguf` with `threads` threads (for decode and batches),
    a context of 4,096 unless `options` say otherwise."""
    # always the libllama built here: pip may hand out a wheel it cached from a build on another
    # CPU (llama.cpp compiles for the building machine's instructions: an illegal instruction here)
    os.environ["LLAMA_CPP_LIB_PATH"] = str(build_llama_cpp())
    sys.path.insert(0, str(build_python()))
    from llama_cpp import Llama

    options = {"n_ctx": 4096, **options}
    return Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, verbose=False, **options)


def llama_cpp_stepper(gguf: Path, threads: int):
    """llama-cpp-python's decode, one token per eval, greedy, after the prompt: a step."""
    llm = llama_cpp(gguf, threads)
    llm.eval(llm.tokenize(prompt_text().encode(), add_bos=False))

    def step() -> None:
        llm.eval([llm.sample(temp=0.0)])

    return step


def recur_stepper(precision: str, threads: int):
    """recur's decode step, batch 1, greedy, after the same prompt, as the engine runs it."""
    torch.set_num_threads(threads)
    return stepper(model.load("smollm2", device="cpu", precision=precision))


def prompt_state(lm: model.LanguageModel) -> model.State:
    """One stream's state after the prompt (`prompt_text`), as the steppers decode from it."""
    assert lm.tokenizer is not None
    with torch.no_grad():
        return lm.consume(lm.tokenizer.encode(prompt_text()), lm.new_state(1))[1]


def stepper(lm: model.LanguageModel, forward=None, state: model.State | None = None):
    """`lm`'s decode step, batch 1, greedy, after the prompt (`prompt_text`) or from `state`;
    `forward` (tokens, state) -> (logits, state) is the forward it runs: `lm`'s eager one,
    or the engine's `DecodeStep` (compiled where its probe adopted it)."""
    forward = forward or lm
    state = prompt_state(lm) if state is None else state
    box = {"state": state, "tok": torch.zeros(1, 1, dtype=torch.long)}

    @torch.no_grad()
    def step() -> None:
        box["tok"][0, 0] = lm.next_logits(box["state"]).argmax(-1)
        _, box["state"] = forward(box["tok"], box["state"])

    return step


def rate(step, steps: int) -> float:
    """Tokens/s of a stepper: the median of `steps` timed steps."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return 1 / sorted(times)[len(times) // 2]


def best_rates(steppers: dict, steps: int, rounds: int, llama_cpp: int | None = None) -> dict:
    """Each stepper warmed up (5 steps: a compiled one compiles there), with llama.cpp's on
    the shipped smollm2's file beside them at `llama_cpp` threads where given, then all
    alternating over `rounds` rounds -> each one's best `rate`."""
    if llama_cpp is not None:
        steppers = {
            **steppers,
            "llama.cpp": llama_cpp_stepper(model.checkpoint.resolve("smollm2"), llama_cpp),
        }
    for step in steppers.values():
        for _ in range(5):
            step()
    best = dict.fromkeys(steppers, 0.0)
    for _ in range(rounds):
        for name, step in steppers.items():
            best[name] = max(best[name], rate(step, steps))
    return best


def batch_1(gguf: Path, threads: int, steps: int, rounds: int = 3) -> dict[str, float]:
    """Each side's best of `rounds` rounds, the sides alternating (a shared machine's load
    then falls on both alike)."""
    steppers = {"llama.cpp": llama_cpp_stepper(gguf, threads)}
    steppers.update({p: recur_stepper(p, threads) for p in PRECISIONS})
    best = dict.fromkeys(steppers, 0.0)
    for _ in range(rounds):
        for name, step in steppers.items():
            best[name] = max(best[name], rate(step, steps))
    return best


# -- prompt processing, in-process ------------------------------------------------------------
def prompt_ids() -> list[int]:
    """PROMPT_TOKENS token ids of held-out text (the file's vocabulary: both sides read them)."""
    lm = model.load("smollm2", device="cpu")
    assert lm.tokenizer is not None
    ids = lm.tokenizer.encode(load_split("shakespeare", "valid")[1][1][:8_000])[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    return ids


def llama_cpp_prompt(gguf: Path, threads: int, ids: list[int], flash_attn: bool):
    """llama.cpp processing the prompt in one batch into an empty cache: one call, timed."""
    llm = llama_cpp(gguf, threads, n_batch=PROMPT_TOKENS, n_ubatch=PROMPT_TOKENS, flash_attn=flash_attn)

    def run() -> None:
        llm.reset()
        llm.eval(ids)

    return run


def llama_bench(gguf: Path, threads: int) -> float:
    """llama.cpp's own prompt-processing figure, `llama-bench -p 512 -n 0` (its n_batch 2048,
    n_ubatch 512, three repetitions averaged), the faster of with and without flash
    attention: tokens/s."""
    cmd = [str(build_llama_cpp() / "llama-bench"), "-m", str(gguf), "-p", str(PROMPT_TOKENS), "-n", "0"]
    cmd += ["-t", str(threads), "-fa", "0,1", "-r", "3", "-o", "json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return max(float(test["avg_ts"]) for test in json.loads(out))


def recur_prompt(precision: str, threads: int, ids: list[int]):
    """recur prefilling the prompt into a new state, `segment_len` tokens a step, without
    log-probs (a completion's prompt), as the engine runs it: one call, timed."""
    torch.set_num_threads(threads)
    return prompt_run(model.load("smollm2", device="cpu", precision=precision), ids)


def prompt_run(lm: model.LanguageModel, ids: list[int]):
    """`lm` prefilling `ids` into a new state, as `recur_prompt` runs it: one call."""
    x = torch.tensor([ids])

    def run() -> None:
        state = lm.new_state(1)
        for start in range(0, x.shape[1], lm.segment_len):
            _, state = lm.prefill(x[:, start : start + lm.segment_len], state)

    return run


def prompt_processing(gguf: Path, threads: int, rounds: int = 3) -> dict[str, float]:
    """Tokens/s of each side over a PROMPT_TOKENS prompt: the best of `rounds` rounds of
    three runs each (the median), the sides alternating; llama.cpp's best of with and
    without flash attention, through its bindings and through `llama-bench` (its best
    configuration here)."""
    ids = prompt_ids()
    runs = {
        "llama.cpp": llama_cpp_prompt(gguf, threads, ids, flash_attn=False),
        "llama.cpp fa": llama_cpp_prompt(gguf, threads, ids, flash_attn=True),
    }
    runs.update({p: recur_prompt(p, threads, ids) for p in PRECISIONS})
    for run in runs.values():
        run()  # warm-up
    best = dict.fromkeys([*runs, "llama-bench"], 0.0)
    for _ in range(rounds):
        best["llama-bench"] = max(best["llama-bench"], llama_bench(gguf, threads))
        for name, run in runs.items():
            best[name] = max(best[name], PROMPT_TOKENS * rate(run, 3))
    best["llama.cpp"] = max(best["llama.cpp"], best.pop("llama.cpp fa"), best["llama-bench"])
    return best


# -- 16 concurrent streams, over HTTP ---------------------------------------------------------------
def prompts() -> list[str]:
    text = load_split("shakespeare", "valid")[1][1]
    return [text[20_000 + 700 * i : 20_000 + 700 * i + 400] for i in range(STREAMS)]


def concurrent(post) -> float:
    """Aggregate generated tokens/s of STREAMS clients at once; `post(prompt)` -> tokens made."""
    with cf.ThreadPoolExecutor(STREAMS) as pool:
        list(pool.map(post, prompts()[:2]))  # warm-up
        t0 = time.perf_counter()
        made = sum(pool.map(post, prompts()))
        return made / (time.perf_counter() - t0)


def llama_server_streams(gguf: Path, threads: int) -> float:
    port = free_port()
    cmd = [
        str(build_llama_cpp() / "llama-server"),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(STREAMS),
    ]
    cmd += ["-c", str(STREAMS * 1024), "--port", str(port), "--host", "127.0.0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/health", proc)
        with httpx.Client(base_url=url, timeout=600) as c:

            def post(prompt: str) -> int:
                body = {
                    "prompt": prompt,
                    "n_predict": NEW_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "cache_prompt": False,
                }
                r = c.post("/completion", json=body)
                r.raise_for_status()
                return int(r.json()["tokens_predicted"])

            return concurrent(post)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def model_streams(precision: str, threads: int, steps: int = 24) -> float:
    """recur's STREAMS-row decode step alone, in-process (no server, sessions or Redis), after
    the same prompts, greedy: aggregate tokens/s (STREAMS ÷ the median step). Beside the
    server's figure it splits a gap between the step and the serving around it."""
    torch.set_num_threads(threads)
    lm = model.load("smollm2", device="cpu", precision=precision)
    assert lm.tokenizer is not None
    with torch.no_grad():
        states = [lm.consume(lm.tokenizer.encode(p), lm.new_state(1))[1] for p in prompts()]
        box = {"state": lm.stack_states(states)}

    @torch.no_grad()
    def step() -> None:
        tok = lm.next_logits(box["state"]).argmax(-1, keepdim=True)
        _, box["state"] = lm(tok, box["state"])

    for _ in range(3):  # warm-up
        step()
    return STREAMS * rate(step, steps)


def stream_prompt_tokens() -> int:
    """The streams' prompt tokens in recur's tokenizer (the same file's vocabulary)."""
    tok = model.load("smollm2", device="cpu", precision="int4").tokenizer
    assert tok is not None
    return sum(len(tok.encode(p)) for p in prompts())


def recur_streams(precision: str, threads: int) -> float:
    work = Path(tempfile.mkdtemp(prefix="recur-peers-"))
    redis = Redis(work / "redis")
    server = Server(
        "smollm2",
        redis.url,
        work / "server",
        precision=precision,
        cpu_threads=threads,
        compile=False,
        max_batch_size=STREAMS,
    )
    try:
        with httpx.Client(base_url=server.url, timeout=600) as c:

            def post(prompt: str) -> int:
                body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
                r = c.post("/v1/completions", json=body)
                r.raise_for_status()
                return int(r.json()["usage"]["completion_tokens"])

            return concurrent(post)
    finally:
        server.stop()
        redis.stop()


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer")


# -- the report ---------------------------------------------------------------------------------
ROWS = (  # (name, key, issue 42's target: recur's best path ÷ llama.cpp)
    ("batch-1 decode, tokens/s", "batch_1", 1.0),
    (f"prompt processing, a {PROMPT_TOKENS}-token prompt, tokens/s", "prompt", 1.0),
    (f"{STREAMS} streams x {NEW_TOKENS} tokens, aggregate tokens/s", "streams", 1.5),
)


def section(r: dict) -> str:
    lines = [
        SECTION,
        "",
        f"`make bench-peers` (`python bench/llm_peers.py`): llama.cpp ({LLAMA_CPP_PYTHON}, built here from the "
        f"package index's sdist) and recur on the same GGUF file, {r['threads']} threads each, on a "
        f"{r['cpus']}-core machine shared with other jobs (load average {r['load'][0]:.1f} at the start, "
        f"{r['load'][1]:.1f} at the end: above {r['cpus']}, other jobs took cores). Batch 1 and prompt "
        "processing alternate the sides in rounds and keep each one's best; the servers run one after the "
        "other. recur eager, with the file dequantized to fp32, or packed as int8 or int4 (int4 is what "
        "`--precision auto`, the default, serves for this file where recur's int4 kernel is built).",
        "",
        "| | llama.cpp | recur fp32 | recur int8 | recur int4 | best ratio | target (issue 42) | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, key, target in ROWS:
        if key not in r:
            lines.append(f"| {name} | not measured in this run (`--parts`) | | | | | {target}x | |")
            continue
        row = r[key]
        best = max(row[p] for p in PRECISIONS) / row["llama.cpp"]
        lines.append(
            f"| {name} | {row['llama.cpp']:.1f} | "
            + " | ".join(f"{row[p]:.1f}" for p in PRECISIONS)
            + f" | {best:.2f}x | {target}x | "
            + ("met |" if best >= target else f"**missed** by {target / best:.1f}x |")
        )
    if "model_streams" in r:
        alone = r["model_streams"]
        lines += [
            "",
            f"recur's {STREAMS}-row decode step alone (in-process, eager, the same prompts): "
            + ", ".join(f"{p} {alone[p]:.1f}" for p in PRECISIONS)
            + " tokens/s; the server keeps "
            + ", ".join(f"{r['streams'][p] / alone[p]:.0%}" for p in PRECISIONS)
            + " of it.",
        ]
    if "model_streams" in r and "prompt" in r:
        bound = serial_bound(r)
        lines[-1] += (
            f" The step alone is not the servers' whole work: both also consume the {STREAMS} prompts "
            f"({r['stream_prompt_tokens']:,} tokens in recur's tokenizer) within the timed run. A server "
            "that wasted nothing around recur's own parts, its prompts at this run's prompt rate and then "
            f"{STREAMS}-row steps at the rate above, would give "
            + ", ".join(f"{p} {bound[p]:.1f}" for p in PRECISIONS)
            + " tokens/s ("
            + ", ".join(f"{bound[p] / r['streams']['llama.cpp']:.2f}x" for p in PRECISIONS)
            + " llama-server); recur's server reaches "
            + ", ".join(f"{r['streams'][p] / bound[p]:.0%}" for p in PRECISIONS)
            + " of that."
        )
    if "prompt" in r:
        lines += [
            "",
            "llama.cpp's prompt processing is its best of four configurations: with and without flash attention, "
            f"through its bindings (one batch of {PROMPT_TOKENS}) and through `llama-bench -p {PROMPT_TOKENS} -n 0` "
            f"(here {r['prompt']['llama-bench']:.1f} tokens/s at best).",
        ]
    lines += ["", why(r), "", "Reproduce: `make bench-peers` (`--write` rewrites this section).", ""]
    return "\n".join(lines)


def serial_bound(r: dict) -> dict[str, float]:
    """Per precision, the aggregate tokens/s of a server that consumed the streams' prompts
    at the run's prompt rate (one 512-token prompt), then decoded them all in full
    STREAMS-row steps at the step-alone rate: no step shared, nothing lost around them."""
    made = STREAMS * NEW_TOKENS
    return {
        p: made / (r["stream_prompt_tokens"] / r["prompt"][p] + made / r["model_streams"][p])
        for p in PRECISIONS
    }


def why(r: dict) -> str:
    """The profile behind the table, with the serial bound read off this run (the note
    under the table)."""
    bound = ""
    if "model_streams" in r and "prompt" in r:
        best = max(serial_bound(r).values()) / r["streams"]["llama.cpp"]
        bound = (
            f"so the target needs both faster than llama-server's: the bound of this run is {best:.2f}x "
            "llama-server. "
        )
    return (
        "Why. Batch 1: a step reads every weight once, so bytes and per-op overhead decide it. recur's int4 "
        "path (model/int4.py) reads the file's Q4_1 blocks as they are, as llama.cpp does, multiplied by "
        "recur's own kernel in fp32 (model/kernels: the fp32 path's numbers, 1.1-1.6x torch's bfloat16 int4 "
        'kernel, section "recur\'s int4 kernel"), but its eager step runs some 2,900 PyTorch ops (3,300 '
        "before one stream's step went "
        'to 3-D views: section "One stream\'s decode step"), and the Python and dispatch between its kernels, '
        "which do not scale with threads, take over half of it; "
        'the compiled step (`--compile`; section "Packed weights", side by side with llama.cpp) removes most of '
        "it. Prompt processing: recur's fp32 prefill runs one GEMM per linear layer over a chunk of 256 tokens, "
        "at about twice the rate of llama.cpp's Q4_1 dot products on this CPU (its CPU backend repacks Q4_0, "
        "Q8_0, IQ4_NL and K-quants into interleaved layouts for such products, not Q4_1); int4 dequantizes each "
        "layer to fp32 for the same GEMM (bfloat16 only beside torch's kernel); int8 multiplies in int8. A prefill without log-probs "
        "runs the head over each chunk's last position alone (section \"A prompt's head\"). 16 streams: each "
        "server consumes the "
        "16 prompts and decodes 16 rows, and its aggregate counts both; recur's serial bound (the note under the "
        "table) is what its own prefill and step allow, "
        + bound
        + "The 16 requests arrive together: the first "
        "decodes while the others still wait on their prompts, which a step now consumes as many budgets of "
        "`--prefill-tokens-per-step` at a time as rows wait per decoding row, in equal chunks, one forward for "
        "them all (`PrefillBudget`, app/engine/prefill.py); at the budget of one prompt they took one row's "
        "32-token chunk a step, and the server kept half of the step alone. What the server still loses (the "
        "engine thread's profile, in \"Against issue 42's targets\" below): the batch's states "
        "restacked as rows join and leave (a copy of every row), the prompts' last chunks, each of its own "
        "length, in a forward of their own, and sampling; the event loop, Redis and the HTTP framing take under "
        "1% of a core. The servers here also run the eager step (no `--compile`: the compile of three batch "
        "classes takes minutes on 2 cores)."
    )


def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--steps", type=int, default=64, help="timed batch-1 decode steps per side")
    ap.add_argument(
        "--parts", default="batch-1,prompt,streams", help="comma list of: batch-1, prompt, streams"
    )
    args = ap.parse_args()
    gguf = model.checkpoint.resolve("smollm2")
    parts = args.parts.split(",")
    T = args.threads
    r = started(threads=T)
    if "batch-1" in parts:
        r["batch_1"] = batch_1(gguf, T, args.steps)
        print(f"batch-1 decode tokens/s: {json.dumps(r['batch_1'])}", flush=True)
    if "prompt" in parts:
        r["prompt"] = prompt_processing(gguf, T)
        print(f"prompt processing tokens/s: {json.dumps(r['prompt'])}", flush=True)
    if "streams" in parts:
        st = {"llama.cpp": llama_server_streams(gguf, T)}
        st.update({p: recur_streams(p, T) for p in PRECISIONS})
        print(f"{STREAMS} streams, aggregate tokens/s: {json.dumps(st)}", flush=True)
        r["streams"] = st
        r["model_streams"] = {p: model_streams(p, T) for p in PRECISIONS}
        r["stream_prompt_tokens"] = stream_prompt_tokens()
        print(f"{STREAMS}-row step alone, tokens/s: {json.dumps(r['model_streams'])}", flush=True)
    r["load"].append(os.getloadavg()[0])
    publish(SECTION, section(r), r, args.write)


if __name__ == "__main__":
    main()
