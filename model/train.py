"""`recur train`: segment-level recurrent training of any model family on a text corpus.

The loop is the Transformer-XL paper's: B parallel streams read in consecutive segments
of `tgt_len` (`corpus.StreamBatches`), the state returned by one segment fed into the
next. Gradients are truncated every `bptt_segments` segments by detaching every tensor of
the carried state (`State.detach`); Transformer-XL already stops gradients into its
memory inside `forward`, so for it 1 is the paper's StopGrad exactly. With N > 1 one
optimiser step consumes N consecutive segments and backpropagates through all of them.

Optimisation: AdamW (weight decay on matrices only), linear warm-up then cosine decay
to `min_lr_ratio * lr`, gradient-norm clipping, fixed seeds, bf16 autocast on CUDA (and
on CPU when asked: `--precision bf16`, a large speed-up on CPUs with AMX).

A run directory holds:
    last/      resumable checkpoint: a normal model checkpoint (config.json,
               model.safetensors, tokenizer.json) plus trainer.safetensors (optimiser
               moments, RNG states, the carried recurrent state) and trainer.json (step,
               train config, optimiser hyper-parameters). No pickle anywhere.
    best/      model checkpoint with the best validation bits per byte so far
    log.csv    step, tokens, lr, train loss, validation bits per byte, elapsed seconds
    loss.png   the loss curve, re-rendered at every evaluation

Resuming (`--resume`) restores model, optimiser, RNG, data position and carried state,
so a resumed run computes the same losses at the same steps as an uninterrupted one.
The learning rate is a pure function of the step, so the schedule needs no state.

This module knows nothing of HTTP or Redis.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from . import checkpoint, corpus, evaluate
from .family import LanguageModel
from .state import State

LOG_FIELDS = ("step", "tokens", "lr", "train_loss", "train_bpb", "valid_bpb", "elapsed_s")


@dataclass
class TrainConfig:
    out: str
    family: str = "transformer-xl"
    model: dict = field(default_factory=dict)  # family config fields (tgt_len is the segment length)
    corpus: str = "shakespeare"
    batch_size: int = 16  # parallel streams
    steps: int = 1000  # optimiser steps
    bptt_segments: int = 1  # segments per step; the state is detached between steps
    lr: float = 1e-3  # peak learning rate, reached at the end of the warm-up
    min_lr_ratio: float = 0.1  # the cosine decays to min_lr_ratio * lr
    warmup: int = 100  # linear warm-up steps
    weight_decay: float = 0.1  # AdamW's, on matrices only
    beta1: float = 0.9  # AdamW's moment decay rates
    beta2: float = 0.99
    grad_clip: float = 1.0  # largest gradient norm (0 = no clipping)
    seed: int = 0  # model init, dropout and the order of works in each epoch
    log_every: int = 10  # steps per log.csv row (the window of its running mean)
    eval_every: int = 200  # steps per validation (0 = never)
    eval_bytes: int = 0  # validate on the first N bytes of each held-out work (0 = all)
    ckpt_every: int = 200  # steps per resumable checkpoint (OUT/last)
    device: str = "auto"  # "auto" (CUDA when there is one) or a torch device
    precision: str = "auto"  # "auto" (bf16 autocast on CUDA, fp32 on CPU) | "bf16" | "fp32"
    threads: int = 0  # torch CPU threads (0 = torch's default)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to `min_lr_ratio * lr`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(lm: LanguageModel, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices, except those a family marks `_no_weight_decay`
    (an SSM's A_log: decay would pull every A towards -1, as mamba_ssm notes)."""

    def decays(p: torch.nn.Parameter) -> bool:
        return p.dim() >= 2 and not getattr(p, "_no_weight_decay", False)

    decay = [p for p in lm.parameters() if p.requires_grad and decays(p)]
    no_decay = [p for p in lm.parameters() if p.requires_grad and not decays(p)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
    )


# -- resumable checkpoints (safetensors + JSON, never pickle) --------------------------------
def save_trainer(
    directory: Path,
    lm: LanguageModel,
    opt: torch.optim.Optimizer,
    cfg: TrainConfig,
    step: int,
    state: State | None,
    extra: dict,
) -> None:
    """Write a resumable checkpoint atomically: into a temporary folder, then renamed."""
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    checkpoint.save(lm, tmp)
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for idx, slots in sd["state"].items():
        for name, t in slots.items():
            tensors[f"opt/{idx}/{name}"] = torch.as_tensor(t).detach().cpu().contiguous()
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, r in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = r
    state_meta = None
    if state is not None:
        for name, t in state.tensors.items():
            tensors[f"state/{name}"] = t.detach().cpu().contiguous()
        state_meta = {
            "family": state.family,
            "fingerprint": state.fingerprint,
            "seq_dims": state.seq_dims,
            "persistent": list(state.persistent),
            "fills": list(state.fills),
        }
    save_file(tensors, str(tmp / "trainer.safetensors"))
    meta = {
        "step": step,
        "config": dataclasses.asdict(cfg),
        "param_groups": sd["param_groups"],
        "state": state_meta,
        **extra,
    }
    (tmp / "trainer.json").write_text(json.dumps(meta, indent=2) + "\n")
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)


def load_trainer(
    directory: Path, lm: LanguageModel, opt: torch.optim.Optimizer
) -> tuple[int, State | None, dict]:
    """Restore model weights, optimiser, RNG; return (step, carried state, metadata)."""
    from safetensors.torch import load_model

    meta = json.loads((directory / "trainer.json").read_text())
    load_model(lm, str(directory / "model.safetensors"), strict=True)
    tensors = load_file(str(directory / "trainer.safetensors"))
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.startswith("opt/"):
            _, idx, name = key.split("/", 2)
            slots.setdefault(int(idx), {})[name] = t.to(lm.device) if name != "step" else t
    opt.load_state_dict({"state": slots, "param_groups": meta["param_groups"]})
    torch.set_rng_state(tensors["rng/cpu"])
    cuda_states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng/cuda/"))]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    state = None
    if meta["state"] is not None:
        sm = meta["state"]
        state = State(
            sm["family"],
            sm["fingerprint"],
            {k[len("state/") :]: t.to(lm.device) for k, t in tensors.items() if k.startswith("state/")},
            {k: int(v) for k, v in sm["seq_dims"].items()},
            tuple(sm["persistent"]),
            fills=tuple(sm.get("fills", ())),
        )
    return int(meta["step"]), state, meta


# -- the loss log -----------------------------------------------------------------------------
def read_log(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def write_log(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=LOG_FIELDS)
        w.writeheader()
        w.writerows(rows)


def append_log(path: Path, row: dict) -> None:
    new = not path.is_file()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=LOG_FIELDS)
        if new:
            w.writeheader()
        w.writerow(row)


def plot_curve(log_csv: str | Path, png: str | Path, title: str = "") -> Path:
    """Render the train loss and validation curves of a `log.csv` to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_log(Path(log_csv))
    train = [(int(r["tokens"]), float(r["train_bpb"])) for r in rows if r["train_bpb"]]
    valid = [(int(r["tokens"]), float(r["valid_bpb"])) for r in rows if r["valid_bpb"]]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(
            [t / 1e6 for t, _ in train], [b for _, b in train], lw=1, alpha=0.8, label="train (running mean)"
        )
    if valid:
        ax.plot(
            [t / 1e6 for t, _ in valid], [b for _, b in valid], "o-", ms=4, label="validation (with memory)"
        )
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("bits per byte")
    if train or valid:
        lo = min(b for _, b in train + valid)
        ax.set_ylim(max(0.0, lo - 0.2), min(8.5, max(lo + 2.5, 3.0)))
    ax.grid(alpha=0.3)
    lrs = [(int(r["tokens"]), float(r["lr"])) for r in rows if r["lr"]]
    if lrs:
        ax2 = ax.twinx()
        ax2.plot(
            [t / 1e6 for t, _ in lrs],
            [lr for _, lr in lrs],
            color="0.6",
            lw=0.8,
            ls="--",
            label="learning rate",
        )
        ax2.set_ylabel("learning rate", color="0.45")
        ax2.set_ylim(0, max(lr for _, lr in lrs) * 1.1)
        handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="upper right")
    else:
        ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    out = Path(png)
    fig.savefig(out)
    plt.close(fig)
    return out


# -- a run: its setup, where it starts, one optimiser step -----------------------------------------
@dataclass
class TrainingRun:
    """What a training run works with: its model, optimiser and corpus (`_setup`)."""

    cfg: TrainConfig
    out: Path
    lm: LanguageModel
    opt: torch.optim.Optimizer
    batches: corpus.StreamBatches
    valid: list[corpus.Work]
    # CUDA autocast is the family's own (`LanguageModel.autocast`); on CPU, bf16 autocast
    # (fast on CPUs with AMX / AVX-512 bf16) wraps the training forward here
    cpu_autocast: bool

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.lm.segment_len * self.cfg.bptt_segments


def _setup(cfg: TrainConfig) -> TrainingRun:
    """The seeded model in the run's precision, its optimiser, and the corpus as streams."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    device = checkpoint.resolve_device(cfg.device)
    if cfg.bptt_segments < 1:
        raise ValueError("bptt_segments must be >= 1")
    torch.manual_seed(cfg.seed)
    lm = checkpoint.build(cfg.family, cfg.model).to(device)
    precision = cfg.precision if cfg.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be auto, bf16 or fp32, not {cfg.precision!r}")
    lm.precision = precision
    lm.train()
    opt = make_optimizer(lm, cfg)
    assert lm.tokenizer is not None
    splits = {s: corpus.load_split(cfg.corpus, s) for s in ("train", "valid")}
    batches = corpus.StreamBatches(
        [torch.tensor(corpus.encode_work(t, lm.tokenizer)) for _, t in splits["train"]],
        cfg.batch_size,
        lm.segment_len,
        cfg.seed,
    )
    cpu_autocast = precision == "bf16" and device.type == "cpu"
    return TrainingRun(cfg, out, lm, opt, batches, splits["valid"], cpu_autocast)


def _start(run: TrainingRun, resume: bool) -> tuple[int, State | None, dict]:
    """(step, carried state, trainer metadata) to start from: OUT/last's, with log.csv cut
    back to its step, or a fresh start."""
    log_path, last_dir = run.out / "log.csv", run.out / "last"
    step: int = 0
    state: State | None = None
    meta: dict = {}
    if resume:
        if not (last_dir / "trainer.json").is_file():
            raise FileNotFoundError(f"nothing to resume: no {last_dir / 'trainer.json'}")
        step, state, meta = load_trainer(last_dir, run.lm, run.opt)
        write_log(log_path, [r for r in read_log(log_path) if int(r["step"]) <= step])
    else:
        log_path.unlink(missing_ok=True)
    (run.out / "train_config.json").write_text(json.dumps(dataclasses.asdict(run.cfg), indent=2) + "\n")
    return step, state, meta


def _optimise(run: TrainingRun, state: State | None, step: int, lr: float) -> tuple[float, State]:
    """Optimiser step `step`: its `bptt_segments` consecutive segments, back-propagated
    through all of them. Returns the mean loss and the carried state, cut from the graph."""
    cfg, lm, device = run.cfg, run.lm, run.lm.device
    for g in run.opt.param_groups:
        g["lr"] = lr
    total = torch.zeros((), device=device)
    for k in range(cfg.bptt_segments):
        x, y, new_epoch = run.batches.segment(step * cfg.bptt_segments + k)
        if state is None or new_epoch:
            state = lm.new_state(cfg.batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16) if run.cpu_autocast else contextlib.nullcontext():
            logits, state = lm(x.to(device), state)
        total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1))
    loss = total / cfg.bptt_segments
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(lm.parameters(), cfg.grad_clip)
    run.opt.step()
    assert state is not None
    return float(loss.detach()), state.detach()


def _validate(lm: LanguageModel, works: list[corpus.Work], eval_bytes: int) -> float:
    if eval_bytes > 0:
        works = [(n, t.encode("utf-8")[:eval_bytes].decode("utf-8", errors="ignore")) for n, t in works]
    return evaluate.score_with_memory(lm, works).bpb


# -- what a run reports --------------------------------------------------------------------------
class Report:
    """What a run tells as it goes: the progress bar, log.csv rows of the train loss's
    running mean, and loss.png. The running mean of the log window is part of the resumable
    state: a run stopped mid-window logs the same means after resuming as one that never
    stopped."""

    def __init__(self, run: TrainingRun, meta: dict, step: int, progress: bool):
        self.cfg, self.out, self.tokens_per_step = run.cfg, run.out, run.tokens_per_step
        self.n_params = sum(p.numel() for p in run.lm.parameters())
        self.running, self.running_n = float(meta.get("running_loss", 0.0)), int(meta.get("running_n", 0))
        self.losses: list[float] = []
        self.elapsed0, self.t0 = float(meta.get("elapsed_s", 0.0)), time.perf_counter()
        self.now, self.t_last, self.step_last = self.t0, time.perf_counter(), step
        self.bar = tqdm(
            total=self.cfg.steps,
            initial=step,
            disable=not progress,
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0 if sys.stderr.isatty() else 30.0,
            file=sys.stderr,
        )
        self.bar.write(
            f"recur train: {self.cfg.family}, {self.n_params:,} parameters, {len(run.batches.works)} training works, "
            f"{run.batches.tokens_per_epoch:,} tokens/epoch, {self.tokens_per_step:,} tokens/step, "
            f"device {run.lm.device}"
        )

    def step(self, step: int, loss: float) -> None:
        """Count the loss of the step just taken and move the bar on."""
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss} at step {step}")
        self.losses.append(loss)
        self.running += loss
        self.running_n += 1
        self.now = time.perf_counter()
        rate = self.bar.format_dict.get("rate")  # tqdm's smoothed steps/s (None until it knows)
        tok_s = (
            rate if rate else (step - self.step_last) / max(self.now - self.t_last, 1e-9)
        ) * self.tokens_per_step
        self.bar.set_postfix(
            loss=f"{loss:.3f}", bpb=f"{loss / math.log(2):.3f}", tok_s=f"{tok_s:,.0f}", refresh=False
        )
        self.bar.update(1)

    def log(self, step: int, lr: float, valid_bpb: float | None) -> None:
        """Write the window's running mean (and a validation figure) to log.csv, then start
        a new window; after a validation, re-render loss.png."""
        mean = self.running / self.running_n
        if valid_bpb is not None:
            self.bar.write(
                f"step {step}: validation {valid_bpb:.4f} bits/byte (train {mean / math.log(2):.4f})"
            )
        row = {
            "step": step,
            "tokens": step * self.tokens_per_step,
            "lr": f"{lr:.6g}",
            "train_loss": f"{mean:.5f}",
            "train_bpb": f"{mean / math.log(2):.5f}",
            "valid_bpb": f"{valid_bpb:.5f}" if valid_bpb is not None else "",
            "elapsed_s": f"{self.elapsed0 + self.now - self.t0:.1f}",
        }
        append_log(self.out / "log.csv", row)
        self.running, self.running_n = 0.0, 0
        self.t_last, self.step_last = time.perf_counter(), step
        if valid_bpb is not None and importlib.util.find_spec("matplotlib") is not None:
            # (the curve is a convenience: without the `train` extra, log.csv alone is kept)
            title = f"{self.cfg.family} on {Path(self.cfg.corpus).name}"
            plot_curve(self.out / "log.csv", self.out / "loss.png", title=title)

    def resumable(self) -> dict:
        """What a checkpoint keeps of the report."""
        elapsed = self.elapsed0 + time.perf_counter() - self.t0
        return {"elapsed_s": elapsed, "running_loss": self.running, "running_n": self.running_n}

    def close(self, step: int, best: float) -> dict:
        """The run's summary."""
        self.bar.close()
        return {
            "out": str(self.out),
            "steps": step,
            "params": self.n_params,
            "tokens": step * self.tokens_per_step,
            "best_valid_bpb": best if math.isfinite(best) else None,
            "elapsed_s": round(self.elapsed0 + time.perf_counter() - self.t0, 1),
            "losses": self.losses,
        }


# -- the loop ---------------------------------------------------------------------------------
def train(cfg: TrainConfig, resume: bool = False, progress: bool = True, stop_at: int | None = None) -> dict:
    """Run (or resume) training; returns a summary dict with this call's per-step losses.

    Safe to interrupt at any time: `resume=True` continues from the last checkpoint.
    `stop_at` ends this call after that step (with a checkpoint) without changing the
    schedule, which is still planned for `cfg.steps`: the run can be resumed later.
    """
    run = _setup(cfg)
    step, state, meta = _start(run, resume)
    best = float(meta.get("best_valid_bpb", float("inf")))
    report = Report(run, meta, step, progress)
    end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    while step < end:
        lr = lr_at(cfg, step)
        loss, state = _optimise(run, state, step, lr)
        step += 1
        report.step(step, loss)
        do_eval = cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.steps)
        valid_bpb = _validate(run.lm, run.valid, cfg.eval_bytes) if do_eval else None
        if step % cfg.log_every == 0 or do_eval or step == cfg.steps:
            report.log(step, lr, valid_bpb)
        if valid_bpb is not None and valid_bpb < best:
            best = valid_bpb
            checkpoint.save(run.lm, run.out / "best")
        if step % cfg.ckpt_every == 0 or step == end:
            extra = {"best_valid_bpb": best, **report.resumable()}
            save_trainer(run.out / "last", run.lm, run.opt, cfg, step, state, extra)
    return report.close(step, best)


def load_config(out: str | Path) -> TrainConfig:
    meta = json.loads((Path(out) / "last" / "trainer.json").read_text())
    return TrainConfig(**meta["config"])


# -- CLI wiring (called from model/cli.py's register) -------------------------------------------
MODEL_FLAGS = (
    "n_layer",
    "d_model",
    "n_head",
    "d_head",
    "d_inner",
    "mem_len",
    "tgt_len",
    "dropout",
    "dropatt",
)


def add_subcommand(sub) -> None:  # sub: argparse._SubParsersAction
    p = sub.add_parser(
        "train",
        help="train a model on a text corpus with segment-level recurrence",
        description="Train (or --resume) a model family on a corpus; writes OUT/{last,best}/, log.csv, loss.png.",
    )
    p.add_argument("--out", required=False, help="run directory (default runs/<family>)")
    p.add_argument("--family", default="transformer-xl")
    p.add_argument(
        "--corpus", default="shakespeare", help="'shakespeare' or a .txt file or folder of .txt files"
    )
    p.add_argument("--config", help="JSON object of family config fields (merged under the flags below)")
    for name in MODEL_FLAGS:
        typ = float if name.startswith("drop") else int
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None)
    defaults = TrainConfig(out="")
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("out", "family", "model", "corpus"):
            continue
        typ = type(getattr(defaults, f.name))
        if f.name == "steps":  # None = not given, so --resume can tell an explicit re-plan
            p.add_argument(
                "--steps", type=int, default=None, help=f"optimiser steps (default {defaults.steps})"
            )
            continue
        p.add_argument(
            "--" + f.name.replace("_", "-"), dest=f.name, type=typ, default=getattr(defaults, f.name)
        )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue OUT's run from OUT/last with its saved config (only --steps may re-plan the schedule)",
    )
    p.add_argument(
        "--stop-at", type=int, help="stop after this step (checkpointed; the schedule still spans --steps)"
    )
    p.add_argument(
        "--plot", metavar="RUN_DIR", help="only render RUN_DIR/log.csv to RUN_DIR/loss.png, then exit"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_main)


def _main(args) -> int:
    if args.plot:
        png = plot_curve(Path(args.plot) / "log.csv", Path(args.plot) / "loss.png")
        print(json.dumps({"png": str(png)}))
        return 0
    out = args.out or f"runs/{args.family}"
    if args.resume:
        cfg = load_config(out)
        cfg.device, cfg.threads, cfg.precision = args.device, args.threads, args.precision
        if args.steps is not None:
            # re-plans the cosine from the resumed step on (a deliberate, logged change)
            cfg.steps = args.steps
    else:
        model_cfg = json.loads(args.config) if args.config else {}
        model_cfg.update({k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k) is not None})
        kwargs = {
            f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)
        }
        kwargs.update(out=out, family=args.family, corpus=args.corpus, model=model_cfg)
        if kwargs["steps"] is None:
            kwargs["steps"] = TrainConfig(out=out).steps
        cfg = TrainConfig(**kwargs)
    summary = train(cfg, resume=args.resume, progress=not args.no_progress, stop_at=args.stop_at)
    summary.pop("losses")
    print(json.dumps(summary))
    return 0
