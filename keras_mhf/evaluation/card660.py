"""Card-660-format rare-word similarity (paper Sec. 4.3): the cosine
similarity of the last token's hidden states against human ratings."""

import numpy as np
from keras import ops

from keras_mhf.evaluation.scoring import encode_text
from keras_mhf.evaluation.scoring import pad_batch
from keras_mhf.evaluation.tasks import TaskFileError
from keras_mhf.evaluation.tasks import read_task_file


def last_token_hidden_states(model, tokenizer, texts, batch_size=16):
    """Hidden state of each text's last token from the final layer (after
    the final norm) and from the second-to-last block, as in the paper's
    Sec. 4.3 (Hugging Face `hidden_states[-1]` and `[-2]`)."""
    backbone = model.backbone
    target_block = backbone.num_layers - 2
    finals, penultimates = [], []
    for start in range(0, len(texts), batch_size):
        ids, mask = pad_batch(
            [
                [tokenizer.start_token_id] + encode_text(tokenizer, t)
                for t in texts[start : start + batch_size]
            ]
        )
        captured = {}

        def intercept(x, i):
            if i == target_block:
                captured["h"] = x
            return x

        if target_block >= 0:
            model.score(ids, mask, layer_intercept_fn=intercept)
        final = np.asarray(
            ops.convert_to_numpy(
                backbone({"token_ids": ids, "padding_mask": mask})
            ),
            "float32",
        )
        last = mask.sum(1) - 1
        rows = np.arange(len(ids))
        finals.append(final[rows, last])
        if target_block >= 0:
            h = np.asarray(ops.convert_to_numpy(captured["h"]), "float32")
        else:  # a one-layer model: the second-to-last "layer" is the embedding
            h = (
                np.asarray(ops.convert_to_numpy(backbone.embed(ids)), "float32")
                if hasattr(backbone, "embed")
                else final
            )
        penultimates.append(h[rows, last])
    return np.concatenate(finals), np.concatenate(penultimates)


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
    model, tokenizer, path, batch_size=16, limit=None, on_error="fail"
):
    """Card-660-format word similarity (TSV `word1<TAB>word2<TAB>score`;
    `_` in multi-word terms is read as a space).

    Cosine similarity of the last token's hidden states (final layer and
    second-to-last layer) against the human scores, Pearson and Spearman
    (paper Sec. 4.3). Bad lines and `on_error` as in
    `keras_mhf.evaluation.tasks.read_task_file`; fewer than 2 pairs raise
    `TaskFileError`.

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
    words = sorted({w for p in pairs for w in p[:2]})
    final, penultimate = last_token_hidden_states(
        model, tokenizer, words, batch_size
    )
    index = {w: i for i, w in enumerate(words)}

    def cosine(a, b):
        return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))

    gold = [p[2] for p in pairs]
    metrics, examples = {"pairs": len(pairs)}, []
    if skipped:
        metrics["skipped_lines"] = skipped
    sims = {}
    for name, states in (("final", final), ("second_to_last", penultimate)):
        sims[name] = [
            cosine(states[index[a]], states[index[b]]) for a, b, _ in pairs
        ]
        metrics[f"{name}_pearson"] = pearson(sims[name], gold)
        metrics[f"{name}_spearman"] = spearman(sims[name], gold)
    for k, (a, b, score) in enumerate(pairs):
        examples.append(
            {
                "word1": a,
                "word2": b,
                "gold": score,
                "cosine_final": sims["final"][k],
                "cosine_second_to_last": sims["second_to_last"][k],
            }
        )
    return metrics, examples
