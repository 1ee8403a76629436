"""Hybrid checkpoints made by transformers, converted and served, answer through the OpenAI
SDK as transformers itself answers (issue 43's "converts and serves").

transformers 5.24 (the isolated `.venv-ref-current/`, tests/model/hf_hybrid_chat_reference.py)
builds a random Qwen3.5 (`Qwen3_5ForCausalLM`, Gated DeltaNet layers `rrra`) and a random
Granite-4.0-H (`GraniteMoeHybridForCausalLM`, Mamba-2 layers `rrar`, NoPE, muP multipliers),
perturbed as the parity tests' (tests/model/test_hf_hybrid.py) so that the recurrent state
matters, and saves them with `save_pretrained` beside a byte-level BPE tokenizer with
ChatML's template (tests/model/llama_files.py). In the same subprocess transformers renders
each conversation with the tokenizer's `apply_chat_template`, encodes it and continues it
greedily in float64: the reference, sharing nothing with recur's path.

Here `recur convert` converts each directory and a real server (real Redis, real HTTP)
serves the result; the `openai` SDK asks for a chat completion, a response and its
continuation by `previous_response_id`. Each answer must be transformers' own: the same
prompt token ids (the session's transcript), the same greedy tokens, the same text, the
log-probs within 1e-4. `recur serve --model HF_DIR` serves the source directory directly
with the same answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from openai.types.chat import ChatCompletion

import model
from app.cli import main as recur_cli
from tests.app.servers import serve
from tests.conftest import ServerProcess
from tests.model.llama_files import CONFIG as TOKENIZER_CONFIG
from tests.model.llama_files import write_hf_tokenizer
from tests.model.reference_env import CURRENT
from tests.model.test_hf_hybrid import GRANITE, QWEN
from tests.sensitive import MATTERS

pytestmark = pytest.mark.slow  # (transformers builds, converts and answers: the slow suite, which CI runs)

REF_SCRIPT = Path(__file__).parents[1] / "model" / "hf_hybrid_chat_reference.py"
TOL = 1e-4
MAX_NEW = 10
EOS = 2  # the checkpoints' (the tokenizer's <|im_end|>, ChatML's turn stop)
VOCAB = TOKENIZER_CONFIG["vocab_size"]  # the BPE tokenizer's
CASES = {
    "qwen35-rrra": ("qwen3_5_text", dict(
        QWEN, vocab_size=VOCAB, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
    )),
    "granite-rrar": ("granitemoehybrid", dict(
        GRANITE, vocab_size=VOCAB, num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"],
        mamba_n_groups=2, mamba_chunk_size=7, embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.1, logits_scaling=2.0, position_embedding_type="nope",
    )),
}  # fmt: skip
FIRST = {"role": "user", "content": "Good morrow, fair lady. What light through yonder window breaks?"}
SECOND = {"role": "user", "content": "Speak again, bright angel!"}
OPENING = 2  # the first response's tokens: few enough that its text re-encodes to them
CHATS = [
    {"name": "first", "messages": [FIRST], "max_new_tokens": MAX_NEW},
    {"name": "opening", "messages": [FIRST], "max_new_tokens": OPENING},
    {
        "name": "second",
        "messages": [FIRST, {"role": "assistant", "reply_of": "opening"}, SECOND],
        "max_new_tokens": MAX_NEW,
    },
]
SETTINGS = {"precision": "fp32", "max_tokens": MAX_NEW, "max_prompt_tokens": 400}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each case's directory, as transformers saved it, with its reference answers."""
    out = tmp_path_factory.mktemp("hf-hybrid-served")
    for name in CASES:
        write_hf_tokenizer(out / name, bos_in_text=True)
    spec = [
        {"name": name, "kind": kind, "config": config, "seed": i, "chats": CHATS}
        for i, (name, (kind, config)) in enumerate(CASES.items())
    ]
    (out / "cases.json").write_text(json.dumps(spec))
    CURRENT.run(REF_SCRIPT, out, out / "cases.json", home=out / "hf-home", timeout=600)
    return {name: out / name for name in CASES}


def reference(src: Path) -> dict[str, dict]:
    return json.loads((src / "chat_reference.json").read_text())


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def converted(case: str, checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("converted") / case
    assert recur_cli(["convert", str(checkpoints[case]), str(dst)]) == 0
    return dst


@pytest.fixture(scope="module")
def server(
    converted: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from serve(converted, redis_url, tmp_path_factory, **SETTINGS)


def consumed(server: ServerProcess, sid: str) -> list[int]:
    """Every token id the session's state has consumed, in order (its transcript)."""
    r = httpx.get(f"{server.url}/v1/sessions/{sid}/transcript", timeout=60)
    assert r.status_code == 200, r.text
    return [i for seg in r.json()["segments"] for i in seg["ids"]]


def chat(oa: openai.OpenAI) -> ChatCompletion:
    """The first chat's greedy reply, with its tokens' log-probs."""
    name = oa.models.list().data[0].id
    return oa.chat.completions.create(
        model=name, messages=[FIRST], max_tokens=MAX_NEW, temperature=0, logprobs=True
    )


def assert_the_chat_reply(reply: ChatCompletion, want: dict) -> None:
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
    assert content is not None
    assert_the_reply([t.logprob for t in content], reply.choices[0].message.content or "", want)


def assert_the_reply(got_logprobs: list[float], text: str, want: dict) -> None:
    """A served reply is transformers' greedy one: the same text (the EOS, when it ended
    the reply, left out), and the same tokens' log-probs within TOL."""
    assert min(want["margins"]) > 10 * TOL, "the reference's greedy choice is a near tie: pick another seed"
    assert text == want["text"]
    assert len(got_logprobs) == len(want["logprobs"])
    assert max(abs(a - b) for a, b in zip(got_logprobs, want["logprobs"], strict=True)) <= TOL


def test_the_converted_model_is_the_hybrid_whose_state_matters(case, checkpoints, converted):
    """The conversion names the family and pattern, loads as the source directory does, and
    in these shapes zeroing the recurrent state after the first chat's prompt moves the
    next logits by at least MATTERS: a server that lost it could not answer as below."""
    lm = model.load(converted, device="cpu")
    assert lm.family == ("gdn-hybrid" if case.startswith("qwen") else "mamba2-hybrid")
    assert lm.config.pattern == ("rrra" if case.startswith("qwen") else "rrar")
    assert model.load(checkpoints[case], device="cpu").fingerprint == lm.fingerprint
    ids = torch.tensor([reference(checkpoints[case])["second"]["prompt_ids"]])
    with torch.no_grad():
        _, state = lm(ids[:, :20], lm.new_state(1))
        want, _ = lm(ids[:, 20:], state)
        for part in ("ssm", "conv"):
            moved, _ = lm(ids[:, 20:], state.replace(**{part: torch.zeros_like(state[part])}))
            assert (moved - want).abs().max().item() >= MATTERS, part


def test_chat_completions_answer_as_transformers(server, checkpoints, case):
    want = reference(checkpoints[case])["first"]
    reply = chat(server.openai())
    assert_the_chat_reply(reply, want)
    assert consumed(server, reply.session_id) == want["prompt_ids"] + want["ids"]  # type: ignore[attr-defined]
    # (the BOS is the session's, made with it: not the prompt's)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(want["prompt_ids"]) - 1
    assert reply.choices[0].finish_reason == ("stop" if want["ids"][-1] == EOS else "length")


def test_a_response_and_its_continuation_answer_as_transformers(server, checkpoints, case):
    """The continuation forks the first response's stored state (the recurrent matrices,
    conv windows, keys and values) and prefills only the new turn: its answer is still
    transformers' for the whole conversation rendered anew."""
    ref = reference(checkpoints[case])
    opening = ref["opening"]["prompt_ids"] + ref["opening"]["ids"]
    assert ref["second"]["prompt_ids"][: len(opening)] == opening, (
        "the opening reply's text does not re-encode to its tokens, so no continuation could fork it: "
        "pick another seed or OPENING"
    )
    oa = server.openai()
    name = oa.models.list().data[0].id
    greedy = {"temperature": 0, "include": ["message.output_text.logprobs"]}
    first = oa.responses.create(model=name, input=FIRST["content"], max_output_tokens=OPENING, **greedy)
    second = oa.responses.create(
        model=name,
        input=SECOND["content"],
        previous_response_id=first.id,
        max_output_tokens=MAX_NEW,
        **greedy,
    )
    for got, want in ((first, ref["opening"]), (second, ref["second"])):
        part = got.output[0].content[0]  # type: ignore[union-attr]
        assert_the_reply([t.logprob for t in part.logprobs or []], got.output_text, want)  # type: ignore[union-attr]
        # (the BOS is the session's, made with it: not the input's)
        assert got.usage is not None and got.usage.input_tokens == len(want["prompt_ids"]) - 1
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens == len(opening) - 1


def test_the_source_directory_serves_directly_with_the_same_answers(
    case, checkpoints, redis_url, tmp_path_factory
):
    """`recur serve --model HF_DIR`: no conversion step, the same chat answer."""
    for srv in serve(checkpoints[case], redis_url, tmp_path_factory, **SETTINGS):
        assert_the_chat_reply(chat(srv.openai()), reference(checkpoints[case])["first"])
