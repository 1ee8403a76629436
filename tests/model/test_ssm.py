"""Mamba and Mamba-2: prefill = token by token in any chunking, the scans against the
recurrence, a constant-size state, batching, gradients, checkpoints and state bytes, the
CLI, training."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import model
from model.mamba import linear_scan
from model.ssd import ssd
from model.state import Persist, State, StateError, encode

from .conftest import SSM_TINY, assert_any_chunking_agrees, run_chunks, tiny_config, tiny_ssm

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = list(SSM_TINY)


@st.composite
def stream_and_chunks(draw):
    length = draw(st.integers(2, 40))
    cuts = draw(st.sets(st.integers(1, length - 1), max_size=6))
    bounds = [0, *sorted(cuts), length]
    return length, [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)], draw(st.integers(0, 2**16))


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=8, deadline=None)
@given(case=stream_and_chunks())
def test_prefill_equals_token_by_token_in_any_chunking(family, case):
    length, sizes, seed = case
    assert_any_chunking_agrees(tiny_ssm(family, seed=1), length, sizes, seed, every_state=True)


@pytest.mark.parametrize("T", [1, 2, 3, 7, 8, 33])
def test_the_parallel_scan_is_the_recurrence(T):
    g = torch.Generator().manual_seed(T)
    a, b, h0 = (
        torch.rand(2, T, 3, 4, generator=g),
        torch.randn(2, T, 3, 4, generator=g),
        torch.randn(2, 3, 4, generator=g),
    )
    h, loop = h0, []
    for t in range(T):
        h = a[:, t] * h + b[:, t]
        loop.append(h)
    torch.testing.assert_close(linear_scan(a, b, h0), torch.stack(loop, 1), atol=1e-5, rtol=0)


def test_the_scans_gradient_is_the_recurrences():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(2, 11, 3, dtype=torch.float64, generator=g).requires_grad_()
    b = torch.randn(2, 11, 3, dtype=torch.float64, generator=g).requires_grad_()
    h0 = torch.randn(2, 3, dtype=torch.float64, generator=g).requires_grad_()
    assert torch.autograd.gradcheck(linear_scan, (a, b, h0))


@pytest.mark.parametrize(("T", "Q", "G"), [(1, 4, 1), (5, 5, 2), (13, 4, 2), (16, 3, 4)])
def test_ssd_is_the_recurrence(T, Q, G):
    g = torch.Generator().manual_seed(T)
    n, H, P, N = 2, 4, 3, 5
    x, a = torch.randn(n, T, H, P, generator=g), -torch.rand(n, T, H, generator=g) * 2
    B, C, h = (
        torch.randn(n, T, G, N, generator=g),
        torch.randn(n, T, G, N, generator=g),
        torch.randn(n, H, P, N, generator=g),
    )
    y, last = ssd(x, a, B, C, h, Q)
    Bh, Ch = B.repeat_interleave(H // G, 2), C.repeat_interleave(H // G, 2)
    for t in range(T):  # h_t = a_t h_{t-1} + x_t B_t^T, y_t = h_t C_t
        h = torch.exp(a[:, t])[..., None, None] * h + x[:, t, :, :, None] * Bh[:, t, :, None, :]
        torch.testing.assert_close(y[:, t], (h @ Ch[:, t, :, :, None])[..., 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(last, h, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_state_has_one_size_whatever_the_history(family):
    lm = tiny_ssm(family)
    sizes, nbytes = set(), set()
    with torch.no_grad():
        state = lm.new_state(1)
        for n in (1, 3, 60, 200):
            _, state = lm.consume(torch.randint(0, 258, (n,)), state)
            blob = state.to_bytes()
            sizes.add(len(blob) - int.from_bytes(blob[:8], "little"))  # the payload (the header holds n)
            nbytes.add(state.nbytes())
    assert len(sizes) == 1 and len(nbytes) == 1
    assert not lm.time_axes() and lm.context_window is None


@pytest.mark.parametrize("family", FAMILIES)
def test_a_delta_is_the_whole_state_so_a_commit_writes_a_snapshot(family):
    lm = tiny_ssm(family)
    with torch.no_grad():
        _, s1 = lm(torch.randint(0, 258, (1, 9)))
        _, s2 = lm(torch.randint(0, 258, (1, 4)), s1)
    delta = s2.delta_bytes(since=9)
    assert abs(len(delta) - len(s2.to_bytes())) < 200  # the same tensors, a longer header
    restored = lm.load_state(s1.to_bytes(), [delta])
    for name, t in s2.tensors.items():
        assert torch.equal(restored[name], t), name
    # a budget that only a delta smaller than the snapshot fits: encode picks the snapshot
    budget = len(s2.to_bytes()) - 1
    assert encode(s2, Persist(since=9, delta_budget=budget)).kind == "snapshot"
    half = encode(s2, Persist(dtype="bfloat16"))  # bf16 storage halves every float
    floats = sum(t.numel() for t in s2.tensors.values() if t.is_floating_point())
    assert len(s2.to_bytes()) - len(half.blob) >= 2 * floats - 16


@pytest.mark.parametrize("family", FAMILIES)
def test_next_logits_come_from_the_state(family):
    lm = tiny_ssm(family)
    with torch.no_grad():
        logits, state = lm(torch.randint(0, 258, (2, 13)))
    torch.testing.assert_close(lm.next_logits(state), logits[:, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_state_carries_the_whole_history(family):
    """A token long before the current chunk, beyond the conv's reach, still moves the
    logits: the SSM state carries it."""
    lm = tiny_ssm(family)
    tokens = torch.randint(0, 258, (1, 30))
    other = tokens.clone()
    other[0, 2] = (tokens[0, 2] + 1) % 258
    with torch.no_grad():
        a, _ = lm(tokens)
        b, _ = lm(other)
    assert torch.equal(a[:, :2], b[:, :2])  # causal
    assert (a[:, -1] - b[:, -1]).abs().max() > 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_streams_equal_each_alone(family):
    lm = tiny_ssm(family)
    g = torch.Generator().manual_seed(6)
    histories = [torch.randint(0, 258, (1, n), generator=g) for n in (0, 2, 5, 17)]
    cont = torch.randint(0, 258, (4, 9), generator=g)
    with torch.no_grad():
        states = [lm.consume(h[0], lm.new_state(1))[1] for h in histories]
        alone = [run_chunks(lm, cont[i : i + 1], [4, 1, 4], st0) for i, st0 in enumerate(states)]
        batched, st_b = run_chunks(lm, cont, [4, 1, 4], lm.stack_states(states))
    for i, part in enumerate(lm.split_state(st_b)):
        torch.testing.assert_close(batched[i], alone[i][0][0], atol=1e-5, rtol=0)
        for name, t in alone[i][1].tensors.items():
            torch.testing.assert_close(part[name].float(), t.float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_flow_through_the_carried_state(family):
    """Truncated BPTT cuts where `recur train` detaches: until then a segment's loss reaches
    the conv windows, the SSM state and the last output the previous segment left."""
    lm = tiny_ssm(family)
    lm.train()
    tokens = torch.randint(0, 258, (2, 12))
    _, state = lm(tokens[:, :6], lm.new_state(2))
    leaves = {k: v.detach().clone().requires_grad_() for k, v in state.tensors.items() if k != "n_tokens"}
    logits, _ = lm(tokens[:, 6:11], state.replace(**leaves))
    torch.nn.functional.cross_entropy(logits.reshape(-1, 258), tokens[:, 7:12].reshape(-1)).backward()
    for name in ("conv", "ssm"):
        assert leaves[name].grad is not None and leaves[name].grad.abs().sum() > 0, name
    params = dict(lm.named_parameters())
    assert all(params[n].grad is not None for n in params if "A_log" in n or n.endswith(".D"))


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_and_state_bytes_round_trip(tmp_path, family):
    lm = tiny_ssm(family)
    model.save(lm, tmp_path / "ck")
    again = model.load(tmp_path / "ck", device="cpu")
    assert again.family == family and again.fingerprint == lm.fingerprint
    tokens, nxt = torch.randint(0, 258, (1, 11)), torch.randint(0, 258, (1, 4))
    with torch.no_grad():
        a, sa = lm(tokens)
        assert torch.equal(a, again(tokens)[0])
        restored = again.load_state(sa.to_bytes())
        torch.testing.assert_close(lm(nxt, sa)[0], again(nxt, restored)[0], atol=1e-6, rtol=0)


def _no_constants(name: str):
    raise ValueError(f"config.json holds {name}, which strict JSON readers refuse")


@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.001, 0.1)])
def test_a_mamba2_config_is_strict_json_and_round_trips(tmp_path, dt_limit):
    """Delta's unbounded limit is written as null, not Infinity; a finite one survives."""
    lm = model.build("mamba2", {**SSM_TINY["mamba2"], "dt_limit": dt_limit})
    model.save(lm, tmp_path / "ck")
    json.loads((tmp_path / "ck" / "config.json").read_text(), parse_constant=_no_constants)
    again = model.load(tmp_path / "ck", device="cpu")
    want = (dt_limit[0], None if dt_limit[1] == float("inf") else dt_limit[1])
    assert again.config.dt_limit == lm.config.dt_limit == want
    with pytest.raises(ValueError, match="dt_limit"):
        model.build("mamba2", {**SSM_TINY["mamba2"], "dt_limit": (0.5, 0.0)})


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_states_are_refused(family):
    lm = tiny_ssm(family)
    with torch.no_grad():
        _, state = lm(torch.randint(0, 258, (1, 10)))
    conv, ssm = state["conv"], state["ssm"]
    bad = {
        "a longer conv window": state.replace(conv=torch.cat([conv, conv[:, :, :1]], 2)),
        "a layer missing": state.replace(ssm=ssm[:, :1]),
        "a wider state": state.replace(ssm=torch.cat([ssm, ssm[..., :1]], -1)),
        "non-finite": state.replace(ssm=torch.full_like(ssm, float("inf"))),
        "last_hidden missing": State(
            family, lm.fingerprint, {k: v for k, v in state.tensors.items() if k != "last_hidden"}
        ),
    }
    for why, wrong in bad.items():
        with pytest.raises(StateError):
            lm.load_state(wrong.to_bytes())
            pytest.fail(why)
    with pytest.raises(StateError, match="made by model"):
        tiny_ssm(family, seed=1).load_state(state.to_bytes())
    other = "mamba2" if family == "mamba" else "mamba"
    with pytest.raises(StateError, match="model family"):
        tiny_ssm(other).load_state(state.to_bytes())


@pytest.mark.parametrize(
    ("family", "flags", "expect"),
    [
        (
            "mamba",
            "--n-layer 3 --d-model 24 --d-state 6 --d-conv 3 --expand 3 --dt-rank 5",
            {"d_state": 6, "dt_rank": 5},
        ),
        (
            "mamba2",
            "--n-layer 1 --d-model 32 --d-state 16 --head-dim 16 --n-groups 2 --chunk-size 8",
            {"n_groups": 2},
        ),
    ],
)
def test_recur_init_writes_either_family(tmp_path, capsys, family, flags, expect):
    from app.cli import main

    assert main(["init", str(tmp_path / "m"), "--family", family, *flags.split()]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert out["family"] == cfg["family"] == family
    assert {k: cfg["config"][k] for k in expect} == expect
    lm = model.load(tmp_path / "m", device="cpu")
    assert lm.fingerprint == out["fingerprint"]
    with pytest.raises(SystemExit, match="no option"):
        main(["init", str(tmp_path / "x"), "--family", family, "--mem-len", "4"])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_training_run_reduces_the_loss(tmp_path, text_dir, family):
    """`recur train`'s loop (two segments per step, the state carried), with validation."""
    from model.train import train

    model_cfg = {**SSM_TINY[family], "d_model": 32, "tgt_len": 16}
    cfg = tiny_config(
        tmp_path / "run", text_dir, family=family, model=model_cfg, steps=30, eval_every=15, bptt_segments=2
    )
    losses = train(cfg, progress=False)["losses"]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert model.load(tmp_path / "run" / "last", device="cpu").family == family
