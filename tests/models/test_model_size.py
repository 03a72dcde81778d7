import numpy as np
import pytest

from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import count_parameters
from keras_mhf.models import model_size
from keras_mhf.models import standard_causal_lm
from keras_mhf.utils.keras_utils import count_trainable_parameters


@pytest.mark.parametrize(
    "name, millions",
    [
        ("1b", 1073.8),
        ("1b_h3b10k", 1077.1),
        ("1b_h4b16k", 1146.5),
        ("100m", 112.5),
        ("100m_h4b16k", 138.7),
    ],
)
def test_paper_counts(name, millions):
    assert round(count_parameters(name)["total"] / 1e6, 1) == millions


def test_standard_plus_layers():
    # The paper's parameter-matched controls for MHF H4B16K.
    assert (
        round(count_parameters("100m", extra_layers=4)["total"] / 1e6, 1)
        == 141.6
    )
    assert (
        round(count_parameters("1b", extra_layers=2)["total"] / 1e6, 1)
        == 1174.5
    )


def test_counts_equal_built_models(small_tokenizer):
    mhf = MultiHashFormerCausalLM.from_tokenizer(small_tokenizer, "tiny_h3b64")
    trainable = count_trainable_parameters(mhf)
    counted = count_parameters("tiny_h3b64", small_tokenizer.vocabulary_size())
    assert trainable == counted["total"]
    assert mhf.count_params() - trainable == (
        counted["signature_table_entries"] + counted["decoding_index_entries"]
    )
    std = standard_causal_lm(small_tokenizer, "tiny", extra_layers=2)
    assert (
        std.count_params()
        == count_parameters(
            "tiny", small_tokenizer.vocabulary_size(), extra_layers=2
        )["total"]
    )


def inspect_output(capsys, *arguments):
    """What `keras-mhf inspect ARGUMENTS` prints (in this process; the
    console script is tests/cli/test_cli.py's)."""
    from keras_mhf.cli import main as cli

    capsys.readouterr()
    assert cli.main(["inspect", *arguments]) == 0
    return capsys.readouterr().out


def test_tool_prints_table(capsys):
    out = inspect_output(capsys, "1b_h4b16k", "100m", "--extra-layers", "4")
    assert "1b_h4b16k+4L" in out and "100m+4L" in out and "141.6M" in out


def test_weight_bytes_int8_tables_about_4x_smaller(small_tokenizer):
    mhf = MultiHashFormerCausalLM.from_tokenizer(
        small_tokenizer, "tiny_h3b64", hidden_dim=256, head_dim=64
    )
    before = model_size.weight_bytes(mhf)
    assert before["vocabulary"] == 3 * 64 * 256 * 4
    assert before["total"] == sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in mhf.weights
    )
    mhf.quantize("int8")
    after = model_size.weight_bytes(mhf)
    # int8 values plus one float32 scale per (padded) row.
    assert after["vocabulary"] == 3 * 64 * (256 + 4)
    assert after["index"] == before["index"]
    assert after["other"] < before["other"]


@pytest.mark.large
def test_tool_prints_bytes(capsys):
    out = inspect_output(capsys, "tiny_h3b64", "--bytes", "--quantize", "int8")
    lines = [line for line in out.splitlines() if line.startswith("tiny")]
    assert len(lines) == 2 and "float32" in lines[0] and "int8" in lines[1]
    assert "x smaller" in lines[1]
