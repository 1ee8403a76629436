"""State bytes (exact round trip, bounded storage dtypes, clear errors for bad blobs), and
time-axis tensors grown in place (`Window`, `Growth`: the same results as the functional
path, and no two states ever writing the same rows)."""

from __future__ import annotations

import io
import json
import pickle

import pytest
import torch
from safetensors.torch import save as st_save

import model
from model import StateError
from model.state import ARENA_SLACK, Persist, encode

from .conftest import tiny_txl
from .test_llama import tiny as tiny_llama
from .test_rlt import tiny_rlt


@pytest.fixture(scope="module")
def txl_and_state():
    lm = tiny_txl()
    with torch.no_grad():
        _, st = lm(torch.randint(0, 258, (1, 20), generator=torch.Generator().manual_seed(0)))
    return lm, st


def test_round_trip_gives_identical_continuation(txl_and_state):
    lm, st = txl_and_state
    blob = st.to_bytes()
    st2 = lm.load_state(blob)
    nxt = torch.randint(0, 258, (1, 12))
    with torch.no_grad():
        a, sa = lm(nxt, st)
        b, sb = lm(nxt, st2)
    assert (a - b).abs().max() <= 1e-5
    assert sa.to_bytes() == sb.to_bytes() or (sa["mem"] - sb["mem"]).abs().max() <= 1e-5
    assert int(st2.n_tokens) == 20


def test_multi_stream_round_trip(txl_and_state):
    lm, _ = txl_and_state
    with torch.no_grad():
        _, st = lm(torch.randint(0, 258, (3, 5)))
    st2 = lm.load_state(st.to_bytes())
    assert st2.batch_size == 3
    assert torch.equal(st2["mem"], st["mem"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_storage_halves_size(txl_and_state, dtype):
    lm, st = txl_and_state
    full, half = st.to_bytes(), st.to_bytes(dtype)

    def payload(blob: bytes) -> int:  # past the headers, which a tiny state's bytes are half of
        return len(blob) - 8 - int.from_bytes(blob[:8], "little")

    assert payload(half) < 0.6 * payload(full)
    st2 = lm.load_state(half)
    assert st2["mem"].dtype == torch.float32
    assert (st2["mem"] - st["mem"]).abs().max() < 0.05 * st["mem"].abs().max()


def test_a_verified_snapshot_in_stored_form_is_written_as_it_is(txl_and_state):
    """An imported snapshot, verified by read_state, is the commit's bytes themselves (no
    second encoding) when it is in the form the commit would write; in any other form
    (another storage dtype here) the state is encoded again, in the commit's form."""
    lm, st = txl_and_state
    blob = st.to_bytes()
    loaded = lm.load_state(blob)
    assert encode(loaded, Persist("float32", verified=blob)).blob is blob
    half = st.to_bytes("bfloat16")
    again = encode(lm.load_state(half), Persist("float32", verified=half)).blob
    assert model.state.peek(again).header["dtype"] == "float32"
    assert encode(loaded, Persist("bfloat16", verified=blob)).blob == loaded.to_bytes("bfloat16")


def test_state_from_another_model_is_rejected(txl_and_state):
    lm, st = txl_and_state
    other = tiny_txl(seed=99)
    with pytest.raises(StateError, match="made by model"):
        other.load_state(st.to_bytes())


@pytest.mark.parametrize("cut", [0, 4, 7, 100, -1, -9])
def test_truncated_bytes_are_rejected(txl_and_state, cut):
    lm, st = txl_and_state
    blob = st.to_bytes()
    with pytest.raises(StateError):
        lm.load_state(blob[:cut])


def test_corrupted_payload_is_rejected(txl_and_state):
    lm, st = txl_and_state
    blob = bytearray(st.to_bytes())
    blob[-5] ^= 0x40  # a bit deep inside the tensor data, not the header
    with pytest.raises(StateError, match="checksum"):
        lm.load_state(bytes(blob))


def test_corrupted_header_is_rejected(txl_and_state):
    lm, st = txl_and_state
    blob = bytearray(st.to_bytes())
    blob[12] = ord("!")
    with pytest.raises(StateError):
        lm.load_state(bytes(blob))


def _with_header(tensors, **changes):
    from model.state import checksum_of

    header = {
        "format": 1,
        "family": "transformer-xl",
        "dtype": "float32",
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "checksum": checksum_of(tensors),
    }
    header.update(changes)
    return st_save(tensors, metadata={"recur": json.dumps(header)})


def test_header_lying_about_shapes_is_rejected(txl_and_state):
    lm, st = txl_and_state
    tensors = {k: st[k].contiguous() for k in ("mem", "last_hidden", "n_tokens")}
    lying = {k: list(v.shape) for k, v in tensors.items()}
    lying["mem"] = [1, 2, 8, 64]
    with pytest.raises(StateError, match="header says"):
        lm.load_state(_with_header(tensors, fingerprint=lm.fingerprint, shapes=lying))


def test_well_formed_blob_of_the_wrong_shape_is_rejected(txl_and_state):
    lm, st = txl_and_state
    tensors = {
        "mem": torch.zeros(1, 2, 8, 16),  # d_model is 32
        "last_hidden": torch.zeros(1, 32),
        "n_tokens": torch.tensor([20]),
    }
    with pytest.raises(StateError, match="mem has shape"):
        lm.load_state(_with_header(tensors, fingerprint=lm.fingerprint))
    tensors["mem"] = torch.zeros(1, 2, 9, 32)  # longer than mem_len
    with pytest.raises(StateError, match="memory length"):
        lm.load_state(_with_header(tensors, fingerprint=lm.fingerprint))


def test_non_finite_state_is_rejected(txl_and_state):
    lm, st = txl_and_state
    tensors = {k: st[k].clone().contiguous() for k in ("mem", "last_hidden", "n_tokens")}
    tensors["mem"][0, 0, 0, 0] = float("nan")
    with pytest.raises(StateError, match="non-finite"):
        lm.load_state(_with_header(tensors, fingerprint=lm.fingerprint))


class _Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('pickle payload executed')",))


def test_pickle_payload_is_rejected_not_executed(txl_and_state):
    lm, _ = txl_and_state
    buf = io.BytesIO()
    pickle.dump({"mem": _Boom()}, buf)
    with pytest.raises(StateError):
        lm.load_state(buf.getvalue())
    with pytest.raises(StateError):
        lm.load_state("not bytes")  # type: ignore[arg-type]


def test_fingerprint_is_stable_and_weight_sensitive(tmp_path):
    lm = model.init(
        tmp_path / "a", n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32, mem_len=4, tgt_len=4
    )
    again = model.load(tmp_path / "a", device="cpu")
    assert lm.fingerprint == again.fingerprint
    with torch.no_grad():
        again.layers[0].pos_ff.CoreNet[0].bias[0] += 1e-3
    assert model.fingerprint(again) != lm.fingerprint


# -- delta persistence ------------------------------------------------------------------------
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from model.state import merge, read_blob  # noqa: E402
from tests.conftest import examples  # noqa: E402


@examples(20)
@given(sizes=st.lists(st.integers(1, 20), min_size=1, max_size=8), seed=st.integers(0, 1000))
def test_snapshot_plus_deltas_rebuilds_the_exact_state(sizes, seed):
    lm = tiny_txl()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _, state = lm(torch.randint(0, 258, (1, 3), generator=g))
        snapshot, deltas = state.to_bytes(), []
        for n in sizes:
            before = int(state.n_tokens)
            _, state = lm(torch.randint(0, 258, (1, n), generator=g), state)
            deltas.append(state.delta_bytes(since=before))
    _, merged = merge(snapshot, deltas)
    _, full = read_blob(state.to_bytes())
    assert merged.keys() == full.keys()
    for name in full:
        assert torch.equal(merged[name], full[name]), name
    resumed = lm.load_state(snapshot, deltas)
    nxt = torch.randint(0, 258, (1, 4), generator=g)
    with torch.no_grad():  # the rebuilt key/value cache may differ in the last float bit
        assert (lm(nxt, resumed)[0] - lm(nxt, state)[0]).abs().max() <= 1e-5


# a history of 62 memories (mem_len 8) in the default suite; of 625 in the slow one
@pytest.mark.parametrize("history", [500, pytest.param(5_000, marks=pytest.mark.slow)])
def test_delta_size_grows_with_new_tokens_not_with_history(history):
    lm = tiny_txl()

    def delta_after(history, new):
        with torch.no_grad():
            _, s = lm.consume(torch.randint(0, 258, (history,)), lm.new_state(1))
            _, s2 = lm(torch.randint(0, 258, (1, new)), s)
        return len(s2.delta_bytes(since=history)), len(s2.to_bytes())

    d_short, _ = delta_after(50, 1)
    d_long, snap = delta_after(history, 1)
    d_more, _ = delta_after(history, 4)
    assert abs(d_short - d_long) <= 16  # the same rows; the header's token counts grow digits
    assert d_long < d_more < snap


def test_deltas_out_of_order_are_rejected():
    lm = tiny_txl()
    with torch.no_grad():
        _, s1 = lm(torch.randint(0, 258, (1, 4)))
        _, s2 = lm(torch.randint(0, 258, (1, 2)), s1)
        _, s3 = lm(torch.randint(0, 258, (1, 2)), s2)
    d2, d3 = s2.delta_bytes(since=4), s3.delta_bytes(since=6)
    with pytest.raises(StateError, match="starts at token"):
        lm.load_state(s1.to_bytes(), [d3])
    with pytest.raises(StateError, match="snapshot"):
        lm.load_state(d2)
    assert int(lm.load_state(s1.to_bytes(), [d2, d3]).n_tokens) == 8


# -- growing in place -----------------------------------------------------------------------
FAMILIES = {"transformer-xl": tiny_txl, "rlt": tiny_rlt, "rlt-0": lambda: tiny_rlt(feedback=False)}


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """The two paths do the same arithmetic (bit-identical on the machines we ran), but a
    kernel may read a strided view in another order than a contiguous copy: allow 1e-5."""
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _same_state(a, b) -> None:
    _, ta = model.state.read_blob(a.to_bytes())
    _, tb = model.state.read_blob(b.to_bytes())
    assert set(ta) == set(tb)
    for name in ta:
        _same(ta[name], tb[name])


def _batch(lm, seed: int = 0):
    """Three streams with different histories, stacked (so the shorter are left-padded)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in (3, 11, 17):
        _, st = lm(torch.randint(0, 258, (1, n), generator=g))
        rows.append(st)
    return lm.stack_states(rows)


def _decode(lm, state, steps: int, how: model.Execution, seed: int = 1):
    """Prefill a 4-token chunk, then decode greedily for `steps` steps: (logits, state)."""
    g = torch.Generator().manual_seed(seed)
    out, state = lm(torch.randint(0, 258, (state.batch_size, 4), generator=g), state, how)
    logits = [out]
    for _ in range(steps):
        ids = lm.next_logits(state).argmax(-1, keepdim=True)
        out, state = lm(ids, state, how)
        logits.append(out)
    return torch.cat(logits, 1), state


@pytest.mark.parametrize("family", FAMILIES)
def test_growing_in_place_gives_exactly_the_functional_results(family):
    """Past several arena reallocations (more steps than ARENA_SLACK, twice), in a batch
    whose rows are left-padded: every logit and every state tensor is the same."""
    lm = FAMILIES[family]()
    steps = 2 * ARENA_SLACK + 7
    with torch.no_grad():
        ref_logits, ref = _decode(lm, _batch(lm), steps, model.FUNCTIONAL)
        assert not ref.arenas
        logits, st = _decode(lm, _batch(lm), steps, model.IN_PLACE)
    assert st.arenas and set(st.arenas) <= set(st.seq_dims)  # it did grow in place
    _same(logits, ref_logits)
    assert set(st.tensors) == set(ref.tensors)
    for name in ref.tensors:
        _same(st[name], ref[name])
    for a, b in zip(lm.split_state(st), lm.split_state(ref), strict=True):
        _same_state(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_states_grown_from_one_state_never_write_the_same_rows(family):
    """A fork (or a retried request) extends one state twice: the first extension grows
    in place, the second must copy, and no state's rows change after it was handed out."""
    lm = FAMILIES[family]()
    with torch.no_grad():
        here = model.IN_PLACE
        _, base = lm(torch.randint(0, 258, (1, 9)), None, here)
        _, base = lm(torch.tensor([[5]]), base, here)  # a state that owns the tail of an arena
        before = base.clone()
        a1, sa = lm(torch.tensor([[7]]), base, here)
        b1, sb = lm(torch.tensor([[8]]), base, here)
        a2, sa = lm(torch.tensor([[9, 10]]), sa, here)  # grows sa in place again
        c1, _ = lm(torch.tensor([[8]]), base, here)  # a third extension of base: still correct
        ra1, rsa = lm(torch.tensor([[7]]), before)
        rb1, rsb = lm(torch.tensor([[8]]), before)
        ra2, rsa = lm(torch.tensor([[9, 10]]), rsa)
    for name in base.tensors:
        assert torch.equal(base[name], before[name]), name  # untouched by its three children
    shared = [
        n for n in base.arenas if base[n].untyped_storage().data_ptr() == sa[n].untyped_storage().data_ptr()
    ]
    assert shared, "the first child should have grown in place"
    assert not any(sb[n].untyped_storage().data_ptr() == sa[n].untyped_storage().data_ptr() for n in shared)
    for got, want in [(a1, ra1), (b1, rb1), (a2, ra2), (c1, rb1)]:
        _same(got, want)
    _same_state(sa, rsa)
    _same_state(sb, rsb)


@pytest.mark.parametrize("family", [*FAMILIES, "llama"])
def test_a_stacked_batch_is_laid_out_as_its_decode_steps_grow_it(family):
    """`lm.stack_states` puts the time axes a decode step grows (`batch_layouts`) straight
    into arenas of their layout: the same values as a plain stack (short rows left-padded
    with zeros), and the first in-place decode step appends where the stack put them, with
    the same logits, instead of copying every row into new arenas."""
    lm = tiny_llama(window=16) if family == "llama" else FAMILIES[family]()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        rows = [lm(torch.randint(0, 258, (1, n), generator=g))[1] for n in (3, 11, 40)]
        rows = [r for st in rows for r in lm.split_state(lm(torch.tensor([[5]]), st, model.IN_PLACE)[1])]
        batch, plain = lm.stack_states(rows), model.State.stack(rows)
        layouts = lm.batch_layouts()
        assert layouts and set(batch.arenas) == set(layouts) and not plain.arenas
        for name in plain.tensors:
            assert torch.equal(batch[name], plain[name]), name
        before = {n: a.data.data_ptr() for n, a in batch.arenas.items()}
        ids = torch.tensor([[1], [2], [3]])
        got, grown = lm(ids, batch, model.IN_PLACE)
        want, _ = lm(ids, plain, model.IN_PLACE)
    assert {n: a.data.data_ptr() for n, a in grown.arenas.items() if n in before} == before
    assert all(grown.arenas[n].time_major == layouts[n] for n in layouts)
    _same(got, want)


def test_a_readied_step_grows_as_the_in_place_step_does():
    """`model.compiled_in_place`, the engine's wrapper of its compiled LLaMA step, readies
    one stream's window arenas outside the forward and hands the forward the arena's layers
    to append to (`Execution.readied`). On the eager forward (the compiled one is
    tests/app/test_compiler_llama.py's), past several arena reallocations as the window
    slides: every logit and state tensor is the in-place step's, the window stays in one
    arena between reallocations, and two steps from one state never write the same rows."""
    lm = tiny_llama(window=16)
    step = model.compiled_in_place(lm, lm.forward)
    prompt = torch.randint(0, 258, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, ref = _decode(lm, lm(prompt)[1], 2 * ARENA_SLACK + 7, model.IN_PLACE)
        state = lm(prompt)[1]
        out, state = step(torch.randint(0, 258, (1, 4), generator=torch.Generator().manual_seed(1)), state)
        logits, arenas = [out], []
        for _ in range(2 * ARENA_SLACK + 7):
            out, state = step(lm.next_logits(state).argmax(-1, keepdim=True), state)
            logits.append(out)
            arenas.append(state.arenas["k"].data)  # (kept alive: no address reused)
        base = state.clone()
        a, sa = step(torch.tensor([[7]]), state)
        b, sb = step(torch.tensor([[8]]), state)  # a second child: its own rows
        ra, rsa = lm(torch.tensor([[7]]), base)
        rb, rsb = lm(torch.tensor([[8]]), base)
    _same(torch.cat(logits, 1), want)
    for name in ref.tensors:
        _same(state[name], ref[name])
    # in place between reallocations, one every ARENA_SLACK steps
    assert 2 <= len({id(t) for t in arenas}) <= 4
    for name in base.tensors:
        assert torch.equal(state[name], base[name]), name  # untouched by its two children
    for got, expected, child, ref_child in [(a, ra, sa, rsa), (b, rb, sb, rsb)]:
        _same(got, expected)
        _same_state(child, ref_child)


def test_under_autograd_states_are_built_functionally():
    """Training back-propagates through the state: no in-place writes, no arenas."""
    lm = tiny_rlt()
    _, st = lm(torch.randint(0, 258, (1, 6)))
    _, st = lm(torch.randint(0, 258, (1, 3)), st)
    assert not st.arenas and st["swa_k"].requires_grad
    with pytest.raises(RuntimeError, match="only without autograd"):
        lm(torch.randint(0, 258, (1, 3)), st, model.IN_PLACE)


# -- huge pages for a batch's new buffers ---------------------------------------------------
def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "unknown"
    return text.split("[")[1].split("]")[0]


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds `address`."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages here")
def test_a_stacked_batch_lies_on_huge_pages():
    """`State.stack` fills a new buffer advised for huge pages (`model.state.huge_pages`):
    its 2 MiB pages are huge ones, and the values are the rows stacked."""
    rows = torch.randn(1, 2, 4096, 256)  # 8 MiB a row
    state = model.State("f", "x", {"k": rows}, {"k": 2}, ("k",))
    batch = model.State.stack([state] * 6)
    same = torch.equal(batch["k"], rows.expand(6, -1, -1, -1))
    middle = batch["k"].data_ptr() + batch["k"].untyped_storage().nbytes() // 2
    huge_kb = _anon_huge_kb(middle)
    assert same
    assert huge_kb >= 2048, f"the batch's mapping holds {huge_kb} kB of huge pages"
