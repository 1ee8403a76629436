"""The checkpoint reader registry (`model/reader.py`, `model.checkpoint.READERS`) and the
commands built from it: `recur convert`'s options are its readers' flags, `recur init`'s
the families' config fields. No reference environment: tiny checkpoints made here."""

from __future__ import annotations

import dataclasses
import json
import re
import typing

import pytest

import model
from app.cli import main as recur_cli
from model import checkpoint, hf, native
from model.cli import init_flags
from model.convert import convert


def test_every_reader_has_one_row_and_the_fallback_is_last():
    names = [reader.name for reader in checkpoint.READERS]
    assert len(set(names)) == len(names)
    assert checkpoint.READERS[-1] is hf.READER  # it claims any directory with config.json


def test_layout_is_the_first_reader_that_claims(tmp_path):
    model.init(tmp_path / "native", family="mamba", n_layer=1, d_model=16, seed=0)
    assert checkpoint.layout(tmp_path / "native") is native.READER
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert checkpoint.layout(other) is hf.READER
    with pytest.raises(FileNotFoundError, match="no checkpoint reader"):
        checkpoint.layout(tmp_path / "nothing")


def test_convert_refuses_a_flag_its_reader_does_not_take(tmp_path, capsys):
    model.init(tmp_path / "src", family="mamba", n_layer=1, d_model=16, seed=0)
    with pytest.raises(ValueError, match="takes no --mem-len"):
        convert(tmp_path / "src", tmp_path / "dst", mem_len=4)
    assert not (tmp_path / "dst").exists()
    assert recur_cli(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--tgt-len", "8"]) == 2
    said = capsys.readouterr().err
    assert re.fullmatch(r"recur convert: .*takes no --tgt-len.*\n", said) and "Traceback" not in said
    # a native checkpoint converts to itself, the same model
    assert recur_cli(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fingerprint"] == model.load(tmp_path / "src", device="cpu").fingerprint


def test_convert_names_a_config_no_reader_reads(tmp_path, capsys):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert recur_cli(["convert", str(tmp_path / "gpt2"), str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err
    assert said.startswith("recur convert: config.json describes a 'gpt2' model") and "Traceback" not in said


def test_init_offers_every_scalar_config_field_of_every_family():
    flags = init_flags()
    for family, cls in checkpoint.families().items():
        hints = typing.get_type_hints(cls.config_class)
        for field in dataclasses.fields(cls.config_class):
            if hints[field.name] in (int, float, str, bool):
                typ, owners = flags[field.name]
                assert typ is hints[field.name] and family in owners


def test_init_takes_a_bool_field(tmp_path, capsys):
    assert recur_cli(["init", str(tmp_path / "m"), "--family", "rlt", "--no-feedback", "--d-model", "16"]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())["config"]
    assert cfg["feedback"] is False and cfg["d_model"] == 16
