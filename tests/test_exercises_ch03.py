"""Chapter 3's exercise checks accept the right answers and reject the usual wrong ones."""

from __future__ import annotations

import pytest

from kvcourse.exercises import ExerciseError, ch03


def _per_token(config, nbytes):
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * nbytes


def test_bytes_per_token_accepts_right_function(capsys):
    assert ch03.check_bytes_per_token(_per_token) is True
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda c, b: _per_token(c, b) / 2, "K and V"),
        (lambda c, b: 2 * c["num_hidden_layers"] * c["num_attention_heads"]
         * (c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]) * b, "num_key_value_heads"),
        (lambda c, b: 2 * c["num_hidden_layers"] * c["num_key_value_heads"]
         * (c["hidden_size"] // c["num_attention_heads"]) * b, "head_dim"),
        (lambda c, b: None, "number"),
        (lambda c, b: _per_token(c, 2), "bytes_per_value"),
    ],
)
def test_bytes_per_token_rejects_wrong_functions(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch03.check_bytes_per_token(wrong)


def test_bytes_per_token_rejects_non_function():
    with pytest.raises(ExerciseError, match="function"):
        ch03.check_bytes_per_token(131072)


def test_max_sequences():
    assert ch03.check_max_sequences(26)
    with pytest.raises(ExerciseError, match="bf16"):
        ch03.check_max_sequences(29)  # weights counted in fp8 too
    with pytest.raises(ExerciseError, match="10\\^9"):
        ch03.check_max_sequences(28)  # GiB instead of GB
    for wrong in (25, 27, "26", None):
        with pytest.raises(ExerciseError):
            ch03.check_max_sequences(wrong)


def test_tp_per_rank():
    assert ch03.check_tp_per_rank(5 * 2**30)
    with pytest.raises(ExerciseError, match="KV heads"):
        ch03.check_tp_per_rank(40 * 2**30 // 16)
    with pytest.raises(ExerciseError):
        ch03.check_tp_per_rank(40 * 2**30)


def test_mla_ratio():
    assert ch03.check_mla_ratio(128 * 320 / 576)
    with pytest.raises(ExerciseError, match="key head"):
        ch03.check_mla_ratio(128 * 256 / 576)
    for wrong in (128 * 320 / 512, 71, "71.1", None):
        with pytest.raises(ExerciseError):
            ch03.check_mla_ratio(wrong)
