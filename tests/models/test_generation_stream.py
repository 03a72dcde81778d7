"""`generate_stream` (`keras_mhf.models.generation_stream`): the tokens and
text of `generate`, a chunk at a time, for MultiHashFormer and the Standard
baseline."""

import keras
import keras_hub
import numpy as np
import pytest
from keras import ops

from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerTokenizer
from keras_mhf.models import standard_causal_lm
from keras_mhf.models.generation_stream import TextPieces
from keras_mhf.models.generation_stream import make_sampler

PROMPTS = ["The cell", "Water boils at one"]
NEW = 10


@pytest.fixture(scope="module")
def models(small_proto):
    tokenizer = MultiHashFormerTokenizer(small_proto)
    keras.utils.set_random_seed(0)
    mhf = MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, "tiny_h3b64", sequence_length=32
    )
    standard = standard_causal_lm(tokenizer, "tiny", sequence_length=32)
    return {"mhf": mhf, "standard": standard}


@pytest.fixture(params=["mhf", "standard"])
def lm(request, models):
    lm = models[request.param]
    preprocessor = lm.preprocessor
    yield lm
    lm.preprocessor = preprocessor


SAMPLERS = {
    "greedy": lambda: keras_hub.samplers.GreedySampler(),
    "top_k": lambda: keras_hub.samplers.TopKSampler(k=4, seed=7),
    "top_p": lambda: keras_hub.samplers.TopPSampler(p=0.9, seed=7),
}
# MHF: its candidate loop (greedy, seeded top-k) and KerasHub's sampler loop
# on its scores (top-p); Standard: KerasHub's sampler loop.
CASES = [
    ("mhf", "greedy"),
    ("mhf", "top_k"),
    ("mhf", "top_p"),
    ("standard", "greedy"),
    ("standard", "top_p"),
]


@pytest.mark.parametrize("name,sampler", CASES)
def test_the_stream_joins_into_generates_text(models, name, sampler):
    """Greedy and seeded sampling: the pieces join into
    `generate(..., strip_prompt=True)`'s text, and come in more than one
    piece (one token first, then chunks)."""
    lm = models[name]
    lm.compile(sampler=SAMPLERS[sampler]())
    want = lm.generate(PROMPTS, max_new_tokens=NEW, strip_prompt=True)
    # The sampler passed to the call (a fresh one of the same seed).
    chunks = list(
        lm.generate_stream(
            PROMPTS, max_new_tokens=NEW, sampler=SAMPLERS[sampler]()
        )
    )
    assert len(chunks) >= 2
    assert all(len(chunk) == len(PROMPTS) for chunk in chunks)
    got = ["".join(chunk[i] for chunk in chunks) for i in range(len(PROMPTS))]
    assert got == want
    if sampler == "greedy":
        # One string: text pieces. Greedy tokens do not depend on the
        # batch, and the second prompt is the longest (the same width).
        pieces = list(lm.generate_stream(PROMPTS[1], max_new_tokens=NEW))
        assert all(isinstance(p, str) and p for p in pieces)
        assert "".join(pieces) == want[1]


def test_token_ids_and_stop_tokens(lm):
    """Without a preprocessor the stream yields each row's new ids, ending
    a row before its first stop token, as `generate` does."""
    lm.compile(sampler="greedy")
    prompt = lm.preprocessor.generate_preprocess(PROMPTS, sequence_length=24)
    prompt = {k: np.asarray(ops.convert_to_numpy(v)) for k, v in prompt.items()}
    lm.preprocessor = None
    full = lm.generate(prompt, stop_token_ids=None, strip_prompt=True)
    lengths = prompt["padding_mask"].sum(1)
    generated = [
        full["token_ids"][i, : 24 - lengths[i]] for i in range(len(PROMPTS))
    ]
    rows = [[] for _ in PROMPTS]
    for chunk in lm.generate_stream(prompt, stop_token_ids=None):
        for i, ids in enumerate(chunk):
            assert ids.dtype == np.int32
            rows[i] += ids.tolist()
    assert rows == [g.tolist() for g in generated]
    # The third new token of row 0 as a stop token: every row ends before
    # its first one.
    stop = int(generated[0][2])
    rows = [[] for _ in PROMPTS]
    for chunk in lm.generate_stream(prompt, stop_token_ids=[stop]):
        for i, ids in enumerate(chunk):
            rows[i] += ids.tolist()
    for row, ids in zip(rows, generated):
        ids = ids.tolist()
        assert row == (ids[: ids.index(stop)] if stop in ids else ids)


def test_stop_strings_end_the_text_before_them(models):
    lm = models["mhf"]
    lm.compile(sampler="greedy")
    text = "".join(lm.generate_stream(PROMPTS[1], max_new_tokens=NEW))
    stop = text[3:5]
    stream = lm.generate_stream(
        PROMPTS[1], max_new_tokens=NEW, stop=[stop, "@@"]
    )
    assert "".join(stream) == text[: text.index(stop)]
    assert stream.finish_reasons == ["stop"]


def test_text_pieces_hold_back_what_may_change(models):
    """A piece never ends with an unfinished character or a text that may
    begin a stop string; the pieces still join into the whole text."""
    preprocessor = models["mhf"].preprocessor
    ids = np.asarray(
        ops.convert_to_numpy(preprocessor.tokenizer("The cell is the unit"))
    ).tolist()
    whole = TextPieces(preprocessor)
    whole.push(ids)
    text = whole.finish() or whole.emitted
    pieces = TextPieces(preprocessor, stop=["unit!"])
    got = [pieces.push([t]) for t in ids]
    assert not any(piece.endswith("un") for piece in got)
    assert "".join(got) + pieces.finish() == text
    assert not pieces.stopped


def test_refusals_match_generate(models):
    lm = models["standard"]
    lm.compile(sampler=keras_hub.samplers.BeamSampler(num_beams=2))
    with pytest.raises(ValueError, match="cannot be streamed"):
        next(iter(lm.generate_stream("The cell", max_new_tokens=4)))
    lm.compile(sampler="greedy")
    long_prompt = "Water boils at one hundred degrees. " * 20
    with pytest.raises(ValueError) as streamed:
        lm.generate_stream(long_prompt, max_length=16)
    with pytest.raises(ValueError) as generated:
        lm.generate(long_prompt, max_length=16)
    assert str(streamed.value) == str(generated.value)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        make_sampler("top_p", temperature=0)


def test_candidate_decoding_counts_its_steps(models):
    lm = models["mhf"]
    lm.compile(sampler="greedy")
    lm.decoding_statistics.reset()
    list(lm.generate_stream(PROMPTS, max_new_tokens=NEW, stop_token_ids=None))
    assert lm.decoding_statistics.steps > 0
