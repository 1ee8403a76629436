"""RLT: prefill = incremental, chunk invariance, causality, bounded caches, batching, gradients,
checkpoints and state bytes, training."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call

import model
from model.checkpoint import build
from model.rlt import RLT
from model.state import State, StateError

from .conftest import assert_any_chunking_agrees, logits_with_one_token_changed, run_chunks, tiny_config

W, C = 3, 8  # window, max_context
TINY_RLT = dict(
    n_encoder_layers=2, n_decoder_layers=2, d_model=16, n_head=2, d_ff=32,
    window=W, memory_groups=2, max_context=C, tgt_len=5,
)  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_rlt(seed: int = 0, **overrides: object) -> RLT:
    torch.manual_seed(seed)
    lm = build("rlt", {**TINY_RLT, **overrides})
    # a strong merge makes the feedback path s_{t-1} -> u_t matter in every test
    with torch.no_grad():
        lm_any: RLT = lm  # type: ignore[assignment]
        if lm_any.merge is not None:
            lm_any.merge.W_s.weight.normal_(0, 0.5)
    lm.fingerprint = model.fingerprint(lm)
    return lm.eval()  # type: ignore[return-value]


@st.composite
def stream_and_chunks(draw):
    length = draw(st.integers(C + 1, 4 * C))  # always longer than max_context
    cuts = set(draw(st.sets(st.integers(1, length - 1), max_size=8)))
    ones = draw(st.lists(st.integers(1, length - 2), max_size=3))  # some size-1 chunks
    bounds = [0, *sorted(cuts | set(ones) | {o + 1 for o in ones}), length]
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    return length, sizes, draw(st.integers(0, 2**16))


@pytest.mark.parametrize("feedback", [True, False])
@settings(max_examples=12, deadline=None)
@given(case=stream_and_chunks())
def test_prefill_equals_incremental_in_any_chunking(feedback, case):
    length, sizes, seed = case
    lm = tiny_rlt(seed=1, feedback=feedback)
    assert_any_chunking_agrees(lm, length, sizes, seed)


@settings(max_examples=10, deadline=None)
@given(case=stream_and_chunks(), history=st.integers(0, 2 * C))
def test_the_fixed_shape_recurrence_equals_the_loop(case, history):
    """`RLT.parts()`'s `decode_token` (what the engine compiles: every step's window and
    memory padded to one shape and masked) gives what the per-token loop gives, in any
    chunking, for two streams whose histories differ (left padding in the batch)."""
    length, sizes, seed = case
    lm = tiny_rlt(seed=2)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 258, (2, length), generator=g)
    short = lm.new_state(1)
    if history:
        _, short = lm(torch.randint(0, 258, (1, history), generator=g), short)
    start = lm.stack_states(
        [short, lm(torch.randint(0, 258, (1, history + 7), generator=g), lm.new_state(1))[1]]
    )
    with torch.no_grad():
        loop, s_loop = run_chunks(lm, tokens, sizes, start)
        fixed, s_fixed = run_chunks(lm, tokens, sizes, start, model.Execution(parts=lm.parts()))
    assert set(lm.parts()) == {"decode_token"}
    assert (loop - fixed).abs().max().item() <= 1e-4
    for name, t in s_loop.tensors.items():
        assert t.shape == s_fixed[name].shape, name
        assert torch.allclose(t.float(), s_fixed[name].float(), atol=1e-5), name
    assert tiny_rlt(feedback=False).parts() == {}  # RLT-0 decodes a chunk at once: no loop


def test_next_logits_come_from_the_state():
    lm = tiny_rlt()
    tokens = torch.randint(0, 258, (2, 13))
    with torch.no_grad():
        logits, state = lm(tokens, lm.new_state(2))
        # next_logits(state) (the head on s, one row per stream) vs logits[:, -1] (the head over
        # every position at once): different kernels, equal within fp32 rounding on any CPU
        torch.testing.assert_close(lm.next_logits(state), logits[:, -1], atol=1e-6, rtol=0)
        # consume = teacher forcing through next_logits + forward, in segment_len chunks
        lp, _ = lm.consume(tokens[0], lm.new_state(1))
        ref = torch.log_softmax(logits[0, :-1], -1).gather(1, tokens[0, 1:, None])[:, 0]
        assert torch.isnan(lp[0, 0]) and torch.allclose(lp[0, 1:], ref, atol=1e-5)


@pytest.mark.parametrize("feedback", [True, False])
def test_causality(feedback):
    la, lb = logits_with_one_token_changed(tiny_rlt(feedback=feedback), 20, 12, seed=3)
    assert torch.equal(la[:, :12], lb[:, :12])  # the past never sees the future
    assert (la[:, 12] - lb[:, 12]).abs().max() > 1e-6  # the token itself matters


def test_feedback_carries_past_the_windows():
    """RLT-1's s_t never resets: a token far beyond every attention window still matters,
    while RLT-0 (no feedback) forgets it once it leaves the receptive field."""
    n = 80  # far beyond W, C and the stacked reach of encoder and decoder windows
    a = torch.randint(0, 258, (1, n), generator=torch.Generator().manual_seed(4))
    b = a.clone()
    b[0, 0] = (a[0, 0] + 1) % 258
    with torch.no_grad():
        for feedback, differs in ((True, True), (False, False)):
            lm = tiny_rlt(feedback=feedback)
            la, _ = lm(a)
            lb, _ = lm(b)
            assert bool((la[:, -1] - lb[:, -1]).abs().max() > 1e-7) is differs


@pytest.mark.parametrize("window", [1, 2, 4])
def test_swa_cache_holds_min_window_minus_one(window):
    lm = tiny_rlt(window=window)
    tokens = torch.randint(0, 258, (1, 12))
    state = lm.new_state(1)
    with torch.no_grad():
        for n in range(1, 13):
            _, state = lm(tokens[:, n - 1 : n], state)
            assert state["swa_k"].shape == (1, 2, min(window - 1, n), 16)
            assert state["swa_v"].shape == state["swa_k"].shape
        _, whole = lm(tokens, lm.new_state(1))  # a prefill of 12 keeps the same amount
        assert whole["swa_k"].shape[2] == min(window - 1, 12)


def test_max_context_bounds_the_state():
    lm = tiny_rlt()
    state, sizes = lm.new_state(1), []
    with torch.no_grad():
        for n in range(1, 4 * C):
            _, state = lm(torch.randint(0, 258, (1, 1)), state)
            sizes.append(len(state.to_bytes()))
            for name in ("enc_k", "enc_v", "mem_k", "mem_v"):
                assert state[name].shape[2] == min(C - 1, n)
        # one chunk longer than max_context keeps the same bound
        _, big = lm(torch.randint(0, 258, (1, 3 * C)), lm.new_state(1))
    assert big["enc_k"].shape[2] == big["mem_k"].shape[2] == C - 1
    assert len(set(sizes[C:])) == 1 and sizes[C] == max(sizes)  # stops growing


def test_attention_reach_is_exactly_max_context():
    """One encoder layer, no feedback, window 1: position t's memory entry sees exactly the
    tokens (t - C, t], and its logits (cross-attention over entries (t - C, t]) exactly
    (t - 2C + 1, t]. Checks the sliding windows, here inside one chunk longer than C."""
    lm = tiny_rlt(n_encoder_layers=1, n_decoder_layers=1, memory_groups=1, window=1, feedback=False)
    t = 4 * C
    a = torch.randint(0, 258, (1, t + 1), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base, base_state = lm(a)
        for j in (t - 2 * C + 1, t - 2 * C + 2, t - C, t - C + 1):
            b = a.clone()
            b[0, j] = (a[0, j] + 1) % 258
            other, other_state = lm(b)
            key_moved = (base_state["mem_k"][0, 0, -1] - other_state["mem_k"][0, 0, -1]).abs().max() > 1e-7
            logits_moved = (base[0, t] - other[0, t]).abs().max() > 1e-7
            assert bool(key_moved) is (j > t - C), j
            assert bool(logits_moved) is (j > t - 2 * C + 1), j


@pytest.mark.parametrize("feedback", [True, False])
def test_batched_streams_equal_each_alone(feedback):
    lm = tiny_rlt(feedback=feedback)
    g = torch.Generator().manual_seed(6)
    histories = [torch.randint(0, 258, (1, n), generator=g) for n in (0, 2, 5, 17)]
    cont = torch.randint(0, 258, (4, 9), generator=g)
    with torch.no_grad():
        alone = []
        states = []
        for i, h in enumerate(histories):
            st0 = lm.new_state(1)
            if h.shape[1]:
                _, st0 = lm(h, st0)
            states.append(st0)
            alone.append(run_chunks(lm, cont[i : i + 1], [4, 5], st0))
        batched, st_b = run_chunks(lm, cont, [4, 5], lm.stack_states(states))
        for i, (logits, _) in enumerate(alone):
            assert (batched[i] - logits[0]).abs().max() <= 1e-5
        for i, part in enumerate(lm.split_state(st_b)):
            for name, t in alone[i][1].tensors.items():
                assert part[name].shape == t.shape, name
                assert torch.allclose(part[name].float(), t.float(), atol=1e-5), name


def test_gradients_of_the_merge_match_finite_differences():
    torch.manual_seed(0)
    lm = build(
        "rlt", {**TINY_RLT, "d_model": 8, "d_ff": 16, "n_decoder_layers": 1, "memory_groups": 1}
    ).double()
    lm.train()
    names = ["merge.gate.weight", "merge.gate.bias", "merge.W_s.weight", "s_star"]
    params = dict(lm.named_parameters())
    tokens = torch.randint(0, 258, (2, 6))

    def loss(*merge_params: torch.Tensor) -> torch.Tensor:
        overrides = dict(zip(names, merge_params, strict=True))
        state = lm.new_state(2)
        state = state.replace(s=overrides["s_star"].expand(2, -1))
        logits, _ = functional_call(lm, {**params, **overrides}, (tokens, state))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 258), tokens[:, 1:].reshape(-1))

    inputs = tuple(params[n].detach().clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-6)


def test_gradients_flow_through_the_carried_state():
    """Full BPTT: a segment's loss reaches s_t, the decoder window caches and the encoder
    and memory entries the previous segment left in the state."""
    lm = tiny_rlt()
    lm.train()
    tokens = torch.randint(0, 258, (2, 12))
    _, state = lm(tokens[:, :6], lm.new_state(2))
    leaves = {k: v.detach().clone().requires_grad_() for k, v in state.tensors.items() if k != "n_tokens"}
    state = state.replace(**leaves)
    logits, _ = lm(tokens[:, 6:11], state)
    torch.nn.functional.cross_entropy(logits.reshape(-1, 258), tokens[:, 7:12].reshape(-1)).backward()
    for name in ("s", "swa_k", "swa_v", "enc_k", "enc_v", "mem_k", "mem_v"):
        assert leaves[name].grad is not None and leaves[name].grad.abs().sum() > 0, name


@pytest.mark.parametrize("overrides", [{}, {"tie_encoder_decoder": True}, {"feedback": False}])
def test_checkpoint_round_trip(tmp_path, overrides):
    lm = tiny_rlt(**overrides)
    model.save(lm, tmp_path / "ck")
    again = model.load(tmp_path / "ck", device="cpu")
    assert isinstance(again, RLT) and again.fingerprint == lm.fingerprint
    tokens = torch.randint(0, 258, (1, 11))
    with torch.no_grad():
        a, sa = lm(tokens)
        b, sb = again(tokens)
        assert torch.equal(a, b)
        # state bytes: the restored state continues like the live one
        restored = again.load_state(sa.to_bytes())
        nxt = torch.randint(0, 258, (1, 4))
        # the live state's tensors are strided views into arenas, the restored ones contiguous
        # copies (other strides): the same values, read by kernels that may sum in another order
        torch.testing.assert_close(lm(nxt, sa)[0], again(nxt, restored)[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(lm.next_logits(sa), again.next_logits(restored), atol=1e-6, rtol=0)


def test_tied_encoder_decoder_shares_weights():
    tied, untied = tiny_rlt(tie_encoder_decoder=True), tiny_rlt()
    assert tied.decoder[1].attn is tied.encoder[1].attn and tied.decoder[0].mlp is tied.encoder[0].mlp
    assert sum(p.numel() for p in tied.parameters()) < sum(p.numel() for p in untied.parameters())


def test_bad_states_are_refused():
    lm = tiny_rlt()
    with torch.no_grad():
        _, state = lm(torch.randint(0, 258, (1, 10)))

    def tampered(**tensors: torch.Tensor) -> bytes:
        return state.replace(**tensors).to_bytes()

    bad = {
        "swa longer than window-1": tampered(swa_k=torch.zeros(1, 2, W, 16), swa_v=torch.zeros(1, 2, W, 16)),
        "memory longer than C-1": tampered(mem_k=torch.zeros(1, 2, C, 16), mem_v=torch.zeros(1, 2, C, 16)),
        "memory shorter than n_tokens": tampered(
            enc_k=state["enc_k"][:, :, 1:], enc_v=state["enc_v"][:, :, 1:]
        ),
        "wrong width": tampered(s=torch.zeros(1, 17)),
        "wrong layer count": tampered(enc_k=state["enc_k"][:, :1], enc_v=state["enc_v"][:, :1]),
        "non-finite": tampered(s=torch.full((1, 16), float("nan"))),
        "negative position": tampered(n_tokens=torch.tensor([-1])),
    }
    for why, blob in bad.items():
        with pytest.raises(StateError):
            lm.load_state(blob)
            pytest.fail(why)
    missing = State("rlt", lm.fingerprint, {k: v for k, v in state.tensors.items() if k != "s"})
    with pytest.raises(StateError):
        lm.load_state(missing.to_bytes())
    other = tiny_rlt(seed=1)
    with pytest.raises(StateError, match="made by model"):
        other.load_state(state.to_bytes())
    with pytest.raises(StateError):
        lm.load_state(state.to_bytes()[:-9])


def test_recur_init_writes_an_rlt(tmp_path, capsys):
    from app.cli import main

    flags = "--n-encoder-layers 1 --n-decoder-layers 3 --d-model 24 --n-head 2 --window 5 --memory-groups 3 --max-context 40 --seed 7"
    assert main(["init", str(tmp_path / "r"), "--family", "rlt", *flags.split()]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert out["family"] == cfg["family"] == "rlt"
    assert {k: cfg["config"][k] for k in ("n_encoder_layers", "n_decoder_layers", "d_model", "window", "max_context")} == {
        "n_encoder_layers": 1, "n_decoder_layers": 3, "d_model": 24, "window": 5, "max_context": 40,
    }  # fmt: skip
    lm = model.load(tmp_path / "r", device="cpu")
    assert lm.fingerprint == out["fingerprint"] and cfg["config"]["memory_groups"] == 3


def test_a_tiny_training_run_reduces_the_loss(tmp_path):
    from model.train import train

    text = "to be or not to be, that is the question. " * 60
    (tmp_path / "corpus.txt").write_text(text)
    rlt = {**TINY_RLT, "d_model": 32, "tgt_len": 16, "max_context": 32, "window": 8}
    run = dict(steps=40, bptt_segments=2, warmup=5, eval_every=0, log_every=10, threads=0)  # no validation
    cfg = tiny_config(tmp_path / "run", tmp_path / "corpus.txt", family="rlt", model=rlt, **run)
    losses = train(cfg, progress=False)["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_the_shipped_rlt_loads_and_knows_shakespeare():
    lm = model.load("shakespeare-rlt", device="cpu")
    assert isinstance(lm, RLT) and lm.fingerprint == model.load("shakespeare-rlt", device="cpu").fingerprint
    from model.corpus import load_split

    name, text = load_split("shakespeare", "test")[0]
    ids = [lm.tokenizer.bos_id, *lm.tokenizer.encode(text[20000:20600])]
    lp, _ = lm.consume(ids, lm.new_state(1))
    bits_per_byte = -float(lp[0, 1:].sum()) / torch.log(torch.tensor(2.0)).item() / (len(ids) - 1)
    assert bits_per_byte < 3.5, (name, bits_per_byte)  # uniform over bytes would be 8

    def greedy() -> list[int]:
        with torch.no_grad():
            _, state = lm(torch.tensor([[lm.tokenizer.bos_id, *lm.tokenizer.encode("ROMEO:")]]))
            out = []
            for _ in range(50):
                nxt = lm.next_logits(state).argmax(-1)
                out.append(int(nxt))
                _, state = lm(nxt[:, None], state)
        return out

    assert greedy() == greedy()
