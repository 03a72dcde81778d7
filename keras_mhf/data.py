"""Text corpora -> packed token blocks for `model.fit` (numpy only).

Documents are read from plain-text files (blank-line separated blocks, or
one document per line when the file has no blank lines), JSONL files (`{"text": ...}` per line) or a
directory of them, tokenized, each prefixed with the BOS token, concatenated
and cut into fixed-length blocks, as the authors' pre-training pipeline does
(no attention reset between documents).
"""

import json
import os

import numpy as np


def read_documents(path, limit=None):
    """Yields document strings from a file, a directory of `.txt`/`.jsonl`,
    or a list of such paths."""
    if isinstance(path, (list, tuple)):
        count = 0
        for item in path:
            for doc in read_documents(item):
                yield doc
                count += 1
                if limit and count >= limit:
                    return
        return
    paths = []
    if os.path.isdir(path):
        for root, _, names in sorted(os.walk(path)):
            paths += [
                os.path.join(root, n)
                for n in sorted(names)
                if n.endswith((".txt", ".jsonl", ".json"))
            ]
        if not paths:
            raise ValueError(f"No .txt or .jsonl files under {path}.")
    elif os.path.exists(path):
        paths = [path]
    else:
        raise FileNotFoundError(f"No such corpus file or directory: {path}")
    count = 0
    for file_path in paths:
        with open(file_path, encoding="utf-8") as f:
            if file_path.endswith((".jsonl", ".json")):
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)["text"]
                    except (ValueError, KeyError, TypeError) as error:
                        raise ValueError(
                            f"{file_path}:{number} is not a JSON object with a "
                            f"'text' field ({error})."
                        ) from error
                    if text.strip():
                        yield text.strip()
                        count += 1
                        if limit and count >= limit:
                            return
            else:
                text = f.read()
                # Blank-line separated documents; a file without blank lines
                # holds one document per line.
                separator = "\n\n" if "\n\n" in text.strip() else "\n"
                for block in text.split(separator):
                    if block.strip():
                        yield block.strip()
                        count += 1
                        if limit and count >= limit:
                            return


def pack_documents(documents, tokenize, bos_id, sequence_length, max_tokens=None):
    """Tokenizes, prefixes BOS, concatenates and cuts blocks of
    `sequence_length + 1` tokens (the remainder is dropped).

    Returns:
        int32 array `[num_blocks, sequence_length + 1]`.
    """
    stream = []
    total = 0
    for text in documents:
        ids = [bos_id] + list(tokenize(text))
        stream.append(np.asarray(ids, "int32"))
        total += len(ids)
        if max_tokens and total >= max_tokens:
            break
    if not stream:
        raise ValueError("The corpus holds no text.")
    tokens = np.concatenate(stream)
    if max_tokens:
        tokens = tokens[:max_tokens]
    block = sequence_length + 1
    count = len(tokens) // block
    if count == 0:
        raise ValueError(
            f"The corpus has {len(tokens)} tokens, fewer than one block of "
            f"{block}; use more text or a shorter sequence_length."
        )
    return tokens[: count * block].reshape(count, block)


def blocks_to_features(blocks):
    """`[n, L+1]` blocks -> (x dict, y, sample_weight) for `fit` without a
    preprocessor."""
    x = {
        "token_ids": blocks[:, :-1],
        "padding_mask": np.ones_like(blocks[:, :-1]),
    }
    return x, blocks[:, 1:], np.ones(blocks[:, 1:].shape, "float32")
