"""`generate` lengths (`max_length`, `max_new_tokens`, `truncate`) and `fit`
inputs, for MultiHashFormer and the Standard baseline
(`keras_mhf.models.causal_lm_inputs`)."""

import keras
import numpy as np
import pytest
from keras import ops
from keras_hub.models import CausalLM

from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerTokenizer
from keras_mhf.models import standard_causal_lm
from keras_mhf.models.causal_lm_inputs import pack_text_prompts

PROMPTS = ["The cell", "Water boils"]
LONG_PROMPT = ("Water boils at one hundred degrees. " * 300)[:10_000]


def to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


@pytest.fixture(scope="module")
def models(small_proto):
    tokenizer = MultiHashFormerTokenizer(small_proto)
    keras.utils.set_random_seed(0)
    mhf = MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, "tiny_h3b64", sequence_length=16
    )
    standard = standard_causal_lm(tokenizer, "tiny", sequence_length=16)
    for lm in (mhf, standard):
        lm.compile(sampler="greedy")
    return {"mhf": mhf, "standard": standard}


@pytest.fixture(params=["mhf", "standard"])
def lm(request, models):
    lm = models[request.param]
    preprocessor = lm.preprocessor
    yield lm
    lm.preprocessor = preprocessor


def ids_prompt(lm, texts, width):
    return lm.preprocessor.generate_preprocess(texts, sequence_length=width)


def test_prompts_that_fit_give_kerashubs_tokens(lm):
    """Defaults, `max_length` and `strip_prompt` return exactly what
    KerasHub's own `CausalLM.generate` returns. (The tests use few shapes:
    each new one compiles the generation function again.)"""
    for kwargs in ({}, {"max_length": 16}, {"strip_prompt": True}):
        assert lm.generate(PROMPTS, **kwargs) == CausalLM.generate(
            lm, PROMPTS, **kwargs
        )
    prompt = ids_prompt(lm, PROMPTS, 16)
    lm.preprocessor = None
    ours = lm.generate(prompt, stop_token_ids=None)
    stock = CausalLM.generate(lm, prompt, stop_token_ids=None)
    for key in ("token_ids", "padding_mask"):
        np.testing.assert_array_equal(ours[key], stock[key])


def test_impossible_lengths_are_refused(lm):
    with pytest.raises(ValueError, match="`max_length` must be >= 1; got 0"):
        lm.generate("The cell", max_length=0)
    with pytest.raises(ValueError, match="must be >= 1; got -2"):
        lm.generate("The cell", max_new_tokens=-2)
    with pytest.raises(ValueError, match="must be an int"):
        lm.generate("The cell", max_length=8.5)
    with pytest.raises(ValueError, match="not both"):
        lm.generate("The cell", max_length=8, max_new_tokens=4)
    with pytest.raises(ValueError, match="`truncate` must be None"):
        lm.generate("The cell", truncate="right")
    with pytest.raises(ValueError, match="prompts\\[1\\] is None"):
        lm.generate(["The cell", None])
    with pytest.raises(ValueError, match="prompts is empty"):
        lm.generate([])


def test_a_length_beyond_memory_is_refused_and_the_model_still_works(lm):
    """A total length whose first pass cannot fit in memory is refused
    before anything runs (`max_length=100_000` asked a tiny model for
    480 GB under JAX, and every later `generate` of the model failed: the
    failed call held its donated weights); the model generates afterwards."""
    expected = lm.generate("The cell", max_length=12)
    for kwargs in ({"max_length": 10**7}, {"max_new_tokens": 10**7}):
        with pytest.raises(
            ValueError,
            match=r"generate: a total length of \d+ tokens for 1 prompt "
            r"needs at least [\d,]+ GB .*pass a smaller max_length or "
            r"max_new_tokens",
        ):
            lm.generate("The cell", **kwargs)
    prompt = ids_prompt(lm, ["The cell"], 8)
    preprocessor, lm.preprocessor = lm.preprocessor, None
    try:
        with pytest.raises(ValueError, match="for 1 prompt needs at least"):
            lm.generate(prompt, max_length=10**7, stop_token_ids=None)
    finally:
        lm.preprocessor = preprocessor
    assert lm.generate("The cell", max_length=12) == expected


def test_max_length_must_exceed_the_prompt(lm):
    text = "Water boils at one"
    length = pack_text_prompts(lm.preprocessor, [text])[1][0]
    with pytest.raises(ValueError, match=f"prompt 0 has {length} tokens"):
        lm.generate(text, max_length=length - 2)
    with pytest.raises(ValueError, match=f"fill max_length={length} "):
        lm.generate(text, max_length=length)
    # Next to a shorter prompt, one that fills max_length is kept whole and
    # gets no new token (KerasHub's batches).
    _, lengths = pack_text_prompts(
        lm.preprocessor, ["The cell", text], max_length=length
    )
    assert lengths[1] == length
    with pytest.raises(ValueError, match="max_length=1 "):
        lm.generate("", max_length=1)
    # One more position leaves room for exactly one new token.
    prompt, lengths = pack_text_prompts(
        lm.preprocessor, [text], max_length=length + 1
    )
    assert lengths == [length]
    assert tuple(prompt["token_ids"].shape) == (1, length + 1)


def test_long_prompt_is_refused_or_truncated_from_the_left(lm):
    with pytest.raises(ValueError, match="sequence_length=16") as error:
        lm.generate(LONG_PROMPT)
    message = str(error.value)
    assert "max_new_tokens" in message and "truncate='left'" in message
    tokens = [int(t) for t in to_numpy(lm.preprocessor.tokenizer(LONG_PROMPT))]
    start = lm.preprocessor.tokenizer.start_token_id
    # Default budget: sequence_length; the prompt keeps 15 tokens.
    prompt, lengths = pack_text_prompts(
        lm.preprocessor, [LONG_PROMPT], truncate="left"
    )
    ids = to_numpy(prompt["token_ids"])[0]
    assert lengths == [15] and ids.shape == (16,)
    assert ids[0] == start and list(ids[1:15]) == tokens[-14:]
    # With max_new_tokens the prompt and new tokens fit in sequence_length.
    prompt, lengths = pack_text_prompts(
        lm.preprocessor, [LONG_PROMPT], max_new_tokens=4, truncate="left"
    )
    ids = to_numpy(prompt["token_ids"])[0]
    assert lengths == [12] and ids.shape == (16,)
    assert ids[0] == start and list(ids[1:12]) == tokens[-11:]
    out = lm.generate([LONG_PROMPT, LONG_PROMPT], truncate="left")
    assert len(out) == 2 and isinstance(out[0], str)
    with pytest.raises(ValueError, match="no room"):
        lm.generate(LONG_PROMPT, max_new_tokens=16, truncate="left")


def test_max_new_tokens_sizes_the_prompt_and_limits_every_row(lm):
    prompt = ids_prompt(lm, PROMPTS, 16)
    lengths = to_numpy(prompt["padding_mask"]).sum(axis=1)
    assert lengths[0] < lengths[1]
    text = lm.generate(PROMPTS, max_new_tokens=3, stop_token_ids=None)
    assert [t.startswith(p) for t, p in zip(text, PROMPTS)] == [True, True]
    lm.preprocessor = None
    out = lm.generate(prompt, max_new_tokens=3, stop_token_ids=None)
    # Total length = longest prompt + 3, and every row got 3 new tokens.
    assert out["token_ids"].shape == (2, lengths[1] + 3)
    np.testing.assert_array_equal(out["padding_mask"].sum(axis=1), lengths + 3)
    # The longest row is what max_length = longest + 3 gives.
    same = lm.generate(
        prompt, max_length=int(lengths[1]) + 3, stop_token_ids=None
    )
    np.testing.assert_array_equal(out["token_ids"][1], same["token_ids"][1])


def test_token_id_prompts(lm):
    prompt = ids_prompt(lm, PROMPTS, 12)
    wide = ids_prompt(lm, PROMPTS, 20)
    assert to_numpy(prompt["padding_mask"]).sum(axis=1).max() < 12
    lm.preprocessor = None
    full = {
        "token_ids": np.full((2, 13), 5, "int32"),
        "padding_mask": np.ones((2, 13), bool),
    }
    with pytest.raises(ValueError, match="max_new_tokens=N"):
        lm.generate(full, stop_token_ids=None)
    out = lm.generate(full, max_new_tokens=3, stop_token_ids=None)
    assert out["token_ids"].shape == (2, 16)
    assert out["padding_mask"].all()
    empty = {"token_ids": full["token_ids"], "padding_mask": np.zeros((2, 13))}
    with pytest.raises(ValueError, match="prompt 0 has no tokens"):
        lm.generate(empty, max_new_tokens=2, stop_token_ids=None)
    with pytest.raises(ValueError, match="token-id prompts are used as given"):
        lm.generate(prompt, truncate="left", stop_token_ids=None)
    with pytest.raises(ValueError, match="takes token ids"):
        lm.generate({"token_ids": full["token_ids"]}, stop_token_ids=None)
    with pytest.raises(ValueError, match="takes token ids"):
        lm.generate(["The cell"], stop_token_ids=None)
    # max_length resizes token-id prompts (it used to be ignored): padding
    # columns are added or removed, prompt tokens are never cut.
    out = lm.generate(prompt, max_length=16, stop_token_ids=None)
    assert out["token_ids"].shape == (2, 16)
    cut = lm.generate(wide, max_length=16, stop_token_ids=None)
    for key in ("token_ids", "padding_mask"):
        np.testing.assert_array_equal(out[key], cut[key])
    with pytest.raises(ValueError, match="max_length=3"):
        lm.generate(prompt, max_length=3, stop_token_ids=None)


def test_dataset_prompts(lm):
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(PROMPTS).batch(2)
    assert lm.generate(dataset) == lm.generate(PROMPTS)


def test_token_id_outputs_of_batches_are_padded_to_one_width():
    from keras_mhf.models.generation import _pad_to_common_width

    a = {"token_ids": np.ones((1, 3), "int32"), "padding_mask": np.ones((1, 3))}
    b = {"token_ids": np.ones((2, 5), "int32"), "padding_mask": np.ones((2, 5))}
    padded = _pad_to_common_width([a, b])
    assert [p["token_ids"].shape for p in padded] == [(1, 5), (2, 5)]
    assert padded[0]["padding_mask"].tolist() == [[1, 1, 1, 0, 0]]


@pytest.mark.parametrize(
    "x, match",
    [
        ([], "x is empty"),
        ([1, 2], "x\\[0\\] is an int \\(1\\). These look like token ids"),
        (["a", None], "x\\[1\\] is None"),
        ([{"a": 1}], "x\\[0\\] is a dict.*lm.preprocessor = None"),
        (["a", 1.5], "x\\[1\\] is a float.*mixed types"),
        ([[3, 4], [5]], "x\\[0\\] is a list.*token ids"),
        ("The cell", "single string; wrap it in a list"),
        (np.array([[1, 2]]), "numpy array of int64"),
        (
            {"token_ids": np.ones((2, 4), "int32")},
            "x is a dict.*lm.preprocessor = None",
        ),
        (None, "no training data"),
    ],
    ids=[
        "empty",
        "ints",
        "none",
        "dict",
        "mixed",
        "id_lists",
        "single_string",
        "int_array",
        "dict_x",
        "no_x",
    ],
)
def test_bad_fit_inputs_fail_at_entry(lm, x, match):
    with pytest.raises(ValueError, match=match):
        lm.fit(x, epochs=1, verbose=0)


def test_bad_fit_datasets_and_preprocessor_calls(lm):
    import tensorflow as tf

    ints = tf.data.Dataset.from_tensor_slices(np.ones((4, 3), "int32"))
    with pytest.raises(ValueError, match="yields int32 values, not strings"):
        lm.fit(ints.batch(2), epochs=1, verbose=0)
    dicts = tf.data.Dataset.from_tensor_slices({"token_ids": np.ones((4, 3))})
    with pytest.raises(ValueError, match="yields dicts"):
        lm.fit(dicts.batch(2), epochs=1, verbose=0)
    with pytest.raises(ValueError, match="x\\[0\\] is an int"):
        lm.preprocessor([1, 2])
    with pytest.raises(ValueError, match="sequence_length"):
        lm.preprocessor(["The cell"], sequence_length=0)
    x, _, _ = lm.preprocessor("The cell")  # one string is fine here
    assert tuple(x["token_ids"].shape) == (16,)
    lm.preprocessor = None
    with pytest.raises(ValueError, match="no training data"):
        lm.fit([], epochs=1, verbose=0)
