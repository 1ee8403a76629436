"""A prompt's head: today's prefill against the commit before it ran the head on one position.

A prefill that wants no log-probs (a completion's or a chat's prompt, every chunk the
server consumes) needs only the logits after its last token (`next_logits`). Until commit
BASE every family ran its head over every position of the chunk and dropped all but the
last: for the shipped smollm2 a 49,152 x 576 product per token, a fifth of a prompt's
FLOPs. Now the forward is told (`model.Execution.last_logits`) and runs it on the last
position alone (tests/model/test_fast_paths.py: the same state to the bit, the same
`next_logits`).

Per weight precision (fp32, int8, int4) and thread count: section 11's prompt (bench/
llm_peers.py's `recur_prompt`: 512 tokens of held-out text into a new state, a chunk of
`segment_len` a step, no log-probs), each side in a process of its own with its model/
first on the path, the sides alternating over rounds, each one's best of three medians;
the rows its head ran over (a hook on the head, so each side counts its own calls) and the
FLOPs of its weight matrices (bench/llm.py's `llama_work` a token for the layers, the
head's per row it ran over); and the machine's limit, measured in the same run: those
FLOPs at the fp32 GEMM rate of that many threads (bench/roofline.py's `gemm_rate`).

`--write` puts the section "## A prompt's head" into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import statistics

import torch
from harness import beside_arguments, beside_rows, publish, started

SECTION = "## A prompt's head"
BASE = "4eae226"  # the commit before a prefill without log-probs ran its head on one position
PRECISIONS = ("fp32", "int8", "int4")


def measure(precision: str, threads: int) -> dict:
    """This process's model/: the prompt's tokens/s (best of 3 medians of 3 runs), the rows
    its head ran over and the FLOPs of its products (linear layers and head) per prompt."""
    import llm_peers as peers
    from llm import llama_work

    import model

    torch.set_num_threads(threads)
    ids = peers.prompt_ids()
    lm = model.load("smollm2", device="cpu", precision=precision)
    run_prompt = peers.prompt_run(lm, ids)
    cfg = lm.config
    head = 2 * cfg.d_model * cfg.vocab_size  # FLOPs a row through the head
    work = llama_work(lm, lm.new_state(1))  # a token's weight matrices, the head's among them
    head_rows, flops = [0], [(work.flops - work.attention_flops - head) * len(ids)]

    def counted(_module, args, _out) -> None:
        rows = args[0].shape[:-1].numel()
        head_rows[0] += rows
        flops[0] += rows * head

    handle = lm.head.register_forward_hook(counted)
    run_prompt()
    handle.remove()
    run_prompt()  # warm-up
    rate = max(len(ids) * peers.rate(run_prompt, 3) for _ in range(3))
    return {"tokens_per_s": rate, "head_rows": head_rows[0], "flops": flops[0], "tokens": len(ids)}


def section(r: dict) -> str:
    lines = [
        SECTION,
        "",
        f"`python bench/prompt_head.py` (`--write` rewrites this section): the shipped smollm2's {r['tokens']}-token "
        f"prompt (section 11's), commit {BASE}'s model/ and today's, each in a process of its own, alternating "
        f"over {r['rounds']} rounds, each one's best; on a {r['cpus']}-core machine (load average "
        f"{r['load'][0]:.1f} at the start, {r['load'][1]:.1f} at the end). The limit: each side's FLOPs (its "
        "linear layers' and its head's) at the fp32 GEMM rate measured in the same run: "
        + ", ".join(
            f"{g / 1e9:.1f} GFLOP/s at {t} thread{'s' if int(t) > 1 else ''}" for t, g in r["gemm"].items()
        )
        + ".",
        "",
        "| weights | threads | head rows, before | today | GFLOP a prompt, before | today | tokens/s before "
        "| today | today ÷ before | today's limit, tokens/s | today's share of it |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in r["rows"]:
        b, t = d["base"], d["today"]
        limit = t["tokens"] / (t["flops"] / r["gemm"][str(d["threads"])])
        lines.append(
            f"| {d['precision']} | {d['threads']} | {b['head_rows']:,} | {t['head_rows']:,} | "
            f"{b['flops'] / 1e9:.1f} | {t['flops'] / 1e9:.1f} | {b['tokens_per_s']:.1f} | {t['tokens_per_s']:.1f} | "
            f"{t['tokens_per_s'] / b['tokens_per_s']:.2f}x | {limit:.1f} | {t['tokens_per_s'] / limit:.0%} |"
        )
    ratios = [d["today"]["tokens_per_s"] / d["base"]["tokens_per_s"] for d in r["rows"]]
    lines += [
        "",
        f"Today ÷ before: median {statistics.median(ratios):.2f}x over the {len(ratios)} rows. The body of the "
        "forward is the same on both sides (the same state to the bit); what changed is the head's rows, one "
        "a chunk where there were as many as its tokens. The packed paths' share of the limit reads against "
        "fp32's GEMM rate, which their int4 and int8 products (in bfloat16 and int8) do not run at.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    from roofline import gemm_rate

    ap = beside_arguments(__doc__, PRECISIONS)
    args = ap.parse_args()
    if args.side:
        precision, threads = args.side.split(",")
        print("RESULT " + json.dumps(measure(precision, int(threads))))
        return
    threads = [int(t) for t in args.threads.split(",")]
    r = started(rounds=args.rounds)
    gemm = {str(t): gemm_rate(t) for t in threads}
    rows = beside_rows("prompt_head.py", BASE, args)
    r["gemm"] = {str(t): max(gemm[str(t)], gemm_rate(t)) for t in threads}
    r["rows"], r["tokens"] = rows, rows[0]["today"]["tokens"]
    r["load"].append(os.getloadavg()[0])
    publish(SECTION, section(r), r, args.write)


if __name__ == "__main__":
    main()
