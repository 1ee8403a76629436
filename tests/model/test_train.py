"""`recur train` / `recur eval` on tiny models and a tiny slice of the real corpus."""

from __future__ import annotations

import json
import math

import pytest
import torch

import model
from app.cli import main as recur
from model import corpus, evaluate
from model.train import TrainConfig, lr_at, read_log, train

from .conftest import tiny_config

TINY = {"n_layer": 2, "d_model": 32, "n_head": 2, "d_head": 16, "d_inner": 64, "mem_len": 16, "tgt_len": 16}


def test_training_reduces_the_loss(tmp_path, text_dir):
    cfg = tiny_config(tmp_path / "run", text_dir, steps=30, eval_every=15)
    summary = train(cfg, progress=False)
    losses = summary["losses"]
    assert len(losses) == 30
    assert losses[0] > math.log(100)  # starts near uniform over 258 ids
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    rows = read_log(tmp_path / "run" / "log.csv")
    assert [int(r["step"]) for r in rows if r["valid_bpb"]] == [15, 30]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    # the final and best checkpoints are ordinary model checkpoints, config as trained
    lm = model.load(tmp_path / "run" / "last", device="cpu")
    assert lm.config.dropout == 0.1 and lm.config.n_layer == 2
    assert model.load(tmp_path / "run" / "best", device="cpu").family == "transformer-xl"


@pytest.mark.parametrize("bptt_segments", [1, 2])
def test_resume_continues_identically(tmp_path, text_dir, bptt_segments):
    whole = train(tiny_config(tmp_path / "whole", text_dir, bptt_segments=bptt_segments), progress=False)
    cfg = tiny_config(tmp_path / "split", text_dir, bptt_segments=bptt_segments)
    first = train(cfg, progress=False, stop_at=5)
    assert len(first["losses"]) == 5
    # a fresh process would rebuild everything from disk: scramble the RNG to prove it is restored
    torch.manual_seed(12345)
    rest = train(cfg, resume=True, progress=False)
    assert rest["steps"] == 12
    assert first["losses"] + rest["losses"] == pytest.approx(whole["losses"], rel=1e-6, abs=1e-6)
    log_whole = read_log(tmp_path / "whole" / "log.csv")
    log_split = read_log(tmp_path / "split" / "log.csv")
    assert [r["train_loss"] for r in log_split] == [r["train_loss"] for r in log_whole]
    assert [r["valid_bpb"] for r in log_split] == [r["valid_bpb"] for r in log_whole]
    a = model.load(tmp_path / "whole" / "last", device="cpu")
    b = model.load(tmp_path / "split" / "last", device="cpu")
    assert a.fingerprint == b.fingerprint


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, text_dir):
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train(tiny_config(tmp_path / "none", text_dir), resume=True, progress=False)


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(out="", steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    lrs = [lr_at(cfg, s) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lr_at(cfg, 100) == pytest.approx(1e-4)


def test_detach_state_cuts_every_tensor_from_the_graph():
    lm = model.build("transformer-xl", TINY)
    lm.train()
    _, st = lm(torch.randint(0, 256, (2, 8)), lm.new_state(2))
    grown = st.replace(last_hidden=st["last_hidden"] * torch.ones((), requires_grad=True))
    assert grown["last_hidden"].requires_grad
    cut = grown.detach()
    assert not any(t.requires_grad for t in cut.tensors.values())
    assert torch.equal(cut["last_hidden"], grown["last_hidden"].detach())
    assert cut.seq_dims == st.seq_dims and cut.persistent == st.persistent


def test_streams_are_contiguous_slices_read_in_consecutive_segments():
    works = [torch.arange(0, 50), torch.arange(100, 170)]
    batches = corpus.StreamBatches(works, batch_size=2, tgt_len=8, seed=0)
    x0, y0, first = batches.segment(0)
    x1, _, later = batches.segment(1)
    assert first and not later
    assert torch.equal(y0[:, :-1], x0[:, 1:])  # targets are the inputs shifted by one
    assert torch.equal(x1[:, 0], y0[:, -1])  # the next segment continues the stream
    s = batches.streams(0)
    assert torch.equal(torch.cat([s[0], s[1]]), torch.cat([works[i] for i in _order(batches)])[: s.numel()])
    # a new epoch starts fresh, from a deterministic reshuffle
    _, _, starts = batches.segment(batches.segments_per_epoch)
    assert starts


def _order(batches: corpus.StreamBatches) -> list[int]:
    s = batches.streams(0)
    return [0, 1] if int(s[0, 0]) == 0 else [1, 0]


def test_shakespeare_split_holds_out_whole_works():
    works = corpus.shakespeare_works()
    assert len(works) == 42
    split = corpus.split_works(works, shakespeare=True)
    names = {k: {n for n, _ in v} for k, v in split.items()}
    assert names["valid"] == set(corpus.SHAKESPEARE_SPLIT["valid"])
    assert names["test"] == set(corpus.SHAKESPEARE_SPLIT["test"])
    assert len(names["valid"] | names["test"]) >= 3
    assert not names["train"] & (names["valid"] | names["test"])
    assert len(names["train"]) + len(names["valid"]) + len(names["test"]) == 42


def test_eval_is_deterministic_and_memory_is_the_only_difference(text_dir):
    torch.manual_seed(0)
    lm = model.build("transformer-xl", TINY).eval()
    works = corpus.read_works(text_dir)[:2]
    works = [(n, t[:700]) for n, t in works]
    first = evaluate.evaluate(lm, works)
    assert evaluate.evaluate(lm, works) == first
    assert first["bytes"] == sum(len(t.encode()) for _, t in works)
    with_mem = evaluate.score_with_memory(lm, works)
    without = evaluate.score_without_memory(lm, works)
    assert with_mem.tokens == without.tokens  # the same predictions are scored
    assert with_mem.bpb != without.bpb
    # a text no longer than one segment has no memory to use: both agree
    short = [("short", works[0][1][: lm.segment_len - 2])]
    a, b = evaluate.score_with_memory(lm, short), evaluate.score_without_memory(lm, short)
    assert a.bits == pytest.approx(b.bits, rel=1e-5)
    # with memory equals scoring the whole work token by token through consume
    ids = corpus.encode_work(works[1][1], lm.tokenizer)
    lp, _ = lm.consume(ids, lm.new_state())
    single = evaluate.score_with_memory(lm, works[1:])
    assert single.bits == pytest.approx(float(-lp[0, 1:].double().sum()) / math.log(2), rel=1e-5)


def test_cli_train_then_eval(tmp_path, text_dir, capsys):
    out = tmp_path / "cli"
    argv = ["train", "--out", str(out), "--corpus", str(text_dir), "--steps", "4", "--batch-size", "2"]
    argv += ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--d-head", "16", "--d-inner", "64"]
    argv += [
        "--tgt-len",
        "16",
        "--mem-len",
        "16",
        "--eval-every",
        "4",
        "--eval-bytes",
        "300",
        "--threads",
        "1",
    ]
    assert recur(argv + ["--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["tokens"] == 4 * 2 * 16
    assert recur(["eval", str(out / "last"), "--text", str(text_dir)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bpb_memory"] > 0 and result["bpb_no_memory"] > 0
    assert result["works"] == [n for n, _ in corpus.read_works(text_dir)]
    with pytest.raises(SystemExit, match="no checkpoint"):
        recur(["eval", str(tmp_path / "missing"), "--text", str(text_dir)])


def test_cli_stop_resume_replan_and_plot(tmp_path, text_dir, capsys):
    out = tmp_path / "replan"
    argv = ["train", "--out", str(out), "--corpus", str(text_dir), "--steps", "8", "--batch-size", "2"]
    argv += ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--d-head", "16", "--d-inner", "64"]
    argv += ["--tgt-len", "16", "--mem-len", "16", "--eval-every", "0", "--threads", "1", "--no-progress"]
    assert recur(argv + ["--stop-at", "3"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 3
    # --resume keeps the saved config; --steps re-plans the schedule from the resumed step
    assert (
        recur(["train", "--out", str(out), "--resume", "--steps", "5", "--threads", "1", "--no-progress"])
        == 0
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 5
    saved = json.loads((out / "last" / "trainer.json").read_text())
    assert saved["step"] == 5 and saved["config"]["steps"] == 5 and saved["config"]["batch_size"] == 2
    (out / "loss.png").unlink(missing_ok=True)
    assert recur(["train", "--plot", str(out)]) == 0
    assert (out / "loss.png").stat().st_size > 1000
