"""Card-660-format rare-word similarity (paper Sec. 4.3): the cosine
similarity of the last token's hidden states against human ratings."""

import keras
import numpy as np
from keras import ops

from keras_mhf.evaluation.scoring import encode_text
from keras_mhf.evaluation.scoring import pad_batch
from keras_mhf.evaluation.tasks import TaskFileError
from keras_mhf.evaluation.tasks import example_records
from keras_mhf.evaluation.tasks import read_task_file
from keras_mhf.models.next_token_scorer import compiled_scorer
from keras_mhf.models.next_token_scorer import predict
from keras_mhf.models.next_token_scorer import scoring_model
from keras_mhf.utils.progress import Progress

# Hidden-state passes pad their length to a multiple of this: a handful of
# compiled shapes for a whole file.
LENGTH_MULTIPLE = 8
# Pairs scored (and their records written) at a time.
PAIRS_PER_CHUNK = 64
HIDDEN_STATES = "card660_hidden_states"


def _hidden_states_model(model):
    """A compiled function of `model` (built once, kept with its scorers):
    `[ids, mask]` -> the final hidden states (after the final norm) and the
    second-to-last block's output (the embeddings for a one-layer model),
    in one trunk pass, no vocabulary scores."""
    backbone = model.backbone

    def build():
        ids = keras.Input((None,), dtype="int32", name="token_ids")
        mask = keras.Input((None,), dtype="int32", name="padding_mask")
        embed = getattr(backbone, "embed", None) or backbone.token_embedding
        x = embed(ids)
        penultimate = x
        for i, block in enumerate(backbone.transformer_layers):
            x = block(x, decoder_padding_mask=mask)
            if i == backbone.num_layers - 2:
                penultimate = x
        final = backbone.layer_norm(x)
        return scoring_model([ids, mask], [final, penultimate])

    return compiled_scorer(model, HIDDEN_STATES, build)


def last_token_hidden_states(
    model, tokenizer, texts, batch_size=16, progress=None
):
    """Hidden state of each text's last token from the final layer (after
    the final norm) and from the second-to-last block, as in the paper's
    Sec. 4.3 (Hugging Face `hidden_states[-1]` and `[-2]`).

    One compiled trunk pass per batch computes both (no vocabulary scores);
    texts are batched by length and padded to a multiple of
    `LENGTH_MULTIPLE`, so a file compiles a handful of shapes and memory
    stays that of one batch. `progress` reports the texts done (`None`:
    the `show_progress` setting).
    """
    sequences = [
        [tokenizer.start_token_id] + encode_text(tokenizer, t) for t in texts
    ]
    order = sorted(range(len(texts)), key=lambda k: len(sequences[k]))
    compiled = _hidden_states_model(model)
    d = model.backbone.hidden_dim
    finals = np.zeros((len(texts), d), "float32")
    penultimates = np.zeros((len(texts), d), "float32")
    bar = Progress("card660 hidden states", len(texts), "words", progress)
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        ids, mask = pad_batch([sequences[k] for k in chosen])
        width = -(-ids.shape[1] // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
        rows = batch_size
        ids = np.pad(ids, ((0, rows - len(ids)), (0, width - ids.shape[1])))
        mask = np.pad(mask, ((0, rows - len(mask)), (0, width - mask.shape[1])))
        mask[len(chosen) :, 0] = 1  # pad rows: one real token, never read
        final, penultimate = predict(model, compiled, [ids, mask])
        last = mask[: len(chosen)].sum(1) - 1
        picked = np.arange(len(chosen))
        final = np.asarray(ops.convert_to_numpy(final), "float32")
        penultimate = np.asarray(ops.convert_to_numpy(penultimate), "float32")
        finals[chosen] = final[picked, last]
        penultimates[chosen] = penultimate[picked, last]
        bar.update(min(start + batch_size, len(order)))
    bar.close()
    return finals, penultimates


def _cosine(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))


def _ranks(x):
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), "float64")
    ranks[order] = np.arange(len(x))
    # Average ranks of ties.
    values = np.asarray(x)[order]
    start = 0
    for end in range(1, len(x) + 1):
        if end == len(x) or values[end] != values[start]:
            ranks[order[start:end]] = (start + end - 1) / 2.0
            start = end
    return ranks


def pearson(x, y):
    x, y = np.asarray(x, "float64"), np.asarray(y, "float64")
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / np.sqrt((x * x).sum() * (y * y).sum()))


def spearman(x, y):
    return pearson(_ranks(x), _ranks(y))


def parse_card660(line):
    """A Card-660 line, `word1<TAB>word2<TAB>score`, as `(word1, word2,
    score)` (`_` in multi-word terms read as a space)."""
    parts = line.rstrip("\r\n").split("\t")
    if len(parts) < 3:
        raise ValueError(
            f"expected word1<TAB>word2<TAB>score, got {len(parts)} field(s)"
        )
    words = [part.replace("_", " ") for part in parts[:2]]
    if not all(word.strip() for word in words):
        raise ValueError("an empty word")
    try:
        score = float(parts[2])
    except ValueError:
        raise ValueError(f"the score {parts[2]!r} is not a number") from None
    if not np.isfinite(score):
        raise ValueError(f"the score {parts[2]!r} is not finite")
    return words[0], words[1], score


def rare_word_similarity(
    model,
    tokenizer,
    path,
    batch_size=16,
    limit=None,
    on_error="fail",
    progress=None,
    results=None,
):
    """Card-660-format word similarity (TSV `word1<TAB>word2<TAB>score`;
    `_` in multi-word terms is read as a space).

    Cosine similarity of the last token's hidden states (final layer and
    second-to-last layer) against the human scores, Pearson and Spearman
    (paper Sec. 4.3). Bad lines and `on_error` as in
    `keras_mhf.evaluation.tasks.read_task_file`; fewer than 2 pairs raise
    `TaskFileError`. `progress` reports the pairs scored, with an ETA.
    With `results` (a `TaskResults`) each pair's record is written as soon
    as its chunk of `PAIRS_PER_CHUNK` pairs is scored, and pairs an earlier
    run recorded are not scored again, as for `keras_mhf.evaluation.lambada`.

    Returns:
        `(metrics, per_example)`.
    """
    pairs, skipped = read_task_file(
        path, parse_card660, on_error, limit, "word pairs"
    )
    if len(pairs) < 2:
        raise TaskFileError(
            f"{path} holds {len(pairs)} word pair: a correlation needs at "
            "least 2."
        )
    done = {} if results is None else dict(results.done)
    todo = [k for k in range(len(pairs)) if k not in done]
    states = {}  # word -> (final, second-to-last) last-token states
    bar = Progress(f"card660 {path}", len(pairs), "pairs", progress)
    chunk = PAIRS_PER_CHUNK
    for start in range(0, len(todo), chunk):
        ks = todo[start : start + chunk]
        new_words = sorted(
            {w for k in ks for w in pairs[k][:2] if w not in states}
        )
        if new_words:
            final, penultimate = last_token_hidden_states(
                model, tokenizer, new_words, batch_size, progress=False
            )
            states.update(zip(new_words, zip(final, penultimate)))
        for k in ks:
            a, b, score = pairs[k]
            record = {
                "word1": a,
                "word2": b,
                "gold": score,
                "cosine_final": _cosine(states[a][0], states[b][0]),
                "cosine_second_to_last": _cosine(states[a][1], states[b][1]),
            }
            if results is not None:
                results.add(k, record)
            done[k] = record
        bar.update(len(pairs) - len(todo) + start + len(ks))
    bar.close()
    examples = example_records(done, len(pairs))
    gold = [e["gold"] for e in examples]
    metrics = {"pairs": len(pairs)}
    if skipped:
        metrics["skipped_lines"] = skipped
    for name in ("final", "second_to_last"):
        sims = [e[f"cosine_{name}"] for e in examples]
        metrics[f"{name}_pearson"] = pearson(sims, gold)
        metrics[f"{name}_spearman"] = spearman(sims, gold)
    return metrics, examples
