"""A checkpoint's recommended sampling (`model/generation_config.py`), read from each place a
checkpoint keeps it: HF's generation_config.json, a GGUF file's `general.sampling.*`
metadata (written here by ggml's own `gguf` writer), or a packaged model's card."""

from __future__ import annotations

import json

import pytest

import model
from model import generation_config
from model.convert import convert
from model.generation_config import GenerationConfig, GenerationConfigError
from tests.conftest import TINY
from tests.model.llama_files import random_weights, write_gguf


def test_hf_generation_config_json(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 300, "eos_token_id": 2})
    )
    got = generation_config.read(tmp_path)
    assert got.recommended() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 300}
    assert got.source.endswith("generation_config.json")


def test_do_sample_false_is_greedy_and_a_file_without_sampling_recommends_nothing(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert generation_config.read(tmp_path).temperature == 0.0
    path.write_text(json.dumps({"eos_token_id": 2, "top_k": 0}))  # HF's top_k 0: off
    assert generation_config.read(tmp_path) == GenerationConfig()


@pytest.mark.parametrize(
    "bad", [{"temperature": -1}, {"top_p": 1.5}, {"top_k": 2.5}, {"temperature": "hot"}, {"max_new_tokens": 0}]
)
def test_a_setting_no_sampler_takes_is_refused(tmp_path, bad):
    (tmp_path / "generation_config.json").write_text(json.dumps(bad))
    with pytest.raises(GenerationConfigError, match=next(iter(bad)).replace("max_new_tokens", "max_tokens")):
        generation_config.read(tmp_path)


def test_gguf_metadata(tmp_path):
    file = write_gguf(
        tmp_path / "m.gguf", random_weights(seed=1), "Q8_0", sampling={"temp": 0.3, "top_p": 0.8, "top_k": 40}
    )
    got = model.load(file).generation_config
    assert got.recommended() == pytest.approx({"temperature": 0.3, "top_p": 0.8, "top_k": 40})
    assert "GGUF" in got.source
    plain = write_gguf(tmp_path / "plain.gguf", random_weights(seed=1), "Q8_0")
    assert model.load(plain).generation_config == GenerationConfig()


def test_a_gguf_file_rewritten_in_place_is_read_again(tmp_path):
    """A load keeps the scalars of the GGUF metadata it parsed (`model.gguf_metadata`), by the
    file's version: a file written again at the same path, with another recommendation and
    another size, is read afresh, never answered from what was kept."""
    file = tmp_path / "m.gguf"
    write_gguf(file, random_weights(seed=1), "Q8_0", sampling={"temp": 0.3})
    assert model.load(file).generation_config.recommended() == pytest.approx({"temperature": 0.3})
    write_gguf(file, random_weights(seed=1), "Q8_0", sampling={"temp": 0.7, "top_k": 5})
    assert generation_config.read(file).recommended() == pytest.approx({"temperature": 0.7, "top_k": 5})
    assert model.load(file).generation_config.recommended() == pytest.approx({"temperature": 0.7, "top_k": 5})


def test_a_packaged_model_without_its_own_finds_its_card(tmp_path):
    file = write_gguf(tmp_path / "m.gguf", random_weights(seed=1), "Q8_0")
    assert generation_config.read(file, "smollm2") == generation_config.CARDS["smollm2"]
    assert generation_config.read(file, "other") == GenerationConfig()


def test_convert_carries_the_recommendation_and_load_reads_it_back(tmp_path):
    file = write_gguf(tmp_path / "m.gguf", random_weights(seed=1), "Q8_0", sampling={"temp": 0.25})
    convert(file, tmp_path / "native")
    assert model.load(tmp_path / "native").generation_config.temperature == 0.25


def test_a_native_checkpoint_without_one_recommends_nothing(tmp_path):
    model.init(tmp_path / "tiny", seed=0, **TINY)
    assert model.load(tmp_path / "tiny").generation_config == GenerationConfig()
