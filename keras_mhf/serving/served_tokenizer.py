"""The tokenizer as `keras-mhf serve` exposes it: text to ids and back, the
special tokens' strings, and each token's text for log-probs."""

import numpy as np
from keras import ops


class ServedTokenizer:
    """A causal LM's SentencePiece tokenizer for the server's endpoints.

    `encode` reads the special tokens' strings (`<s>`, `</s>`) in text as
    those tokens, as Hugging Face tokenizers (and so vLLM's `/tokenize`) do,
    and encodes the text between them with SentencePiece; `decode` is the
    tokenizer's `detokenize`. `token_texts` gives each token's text (the
    piece, `▁` read as a space, byte pieces joined into their character,
    nothing for `<s>` and `</s>`) so that the texts of a sequence's tokens
    join into its text.

    Args:
        tokenizer: a `MultiHashFormerTokenizer`.

    Example:

    ```python
    served = ServedTokenizer(lm.preprocessor.tokenizer)
    ids = served.encode("The cell", add_special_tokens=True)  # <s> first
    ```
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocabulary = list(tokenizer.get_vocabulary())
        self.start_token_id = int(tokenizer.start_token_id)
        self.end_token_id = int(tokenizer.end_token_id)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = None if pad is None else int(pad)
        self.special = {
            self.vocabulary[i]: i
            for i in (self.start_token_id, self.end_token_id)
        }

    @property
    def vocabulary_size(self):
        return len(self.vocabulary)

    def info(self, max_length):
        """`GET /tokenizer_info`: what lm-eval's remote tokenizer reads."""
        pad = self.pad_token_id
        return {
            "tokenizer_class": type(self.tokenizer).__name__,
            "bos_token": self.vocabulary[self.start_token_id],
            "eos_token": self.vocabulary[self.end_token_id],
            "pad_token": None if pad is None else self.vocabulary[pad],
            "model_max_length": int(max_length),
            "vocab_size": self.vocabulary_size,
            "add_bos_token": True,
            "chat_template": None,
        }

    def _encode_text(self, text):
        if not text:
            return []
        ids = self.tokenizer.tokenize(text)
        return [int(i) for i in np.asarray(ops.convert_to_numpy(ids))]

    def encode(self, text, add_special_tokens=False):
        """Token ids of `text` (with `<s>` first if `add_special_tokens`)."""
        ids = [self.start_token_id] if add_special_tokens else []
        rest = text
        while rest:
            found = [
                (rest.find(s), s) for s in self.special if rest.find(s) >= 0
            ]
            if not found:
                ids += self._encode_text(rest)
                break
            at, string = min(found)
            ids += self._encode_text(rest[:at])
            ids.append(self.special[string])
            rest = rest[at + len(string) :]
        return ids

    def decode(self, ids):
        """The text of `ids` (SentencePiece's detokenization)."""
        if len(ids) == 0:
            return ""
        text = self.tokenizer.detokenize(np.asarray(ids, "int32"))
        text = np.asarray(ops.convert_to_numpy(text)).reshape(-1)[0]
        return text.decode("utf-8") if isinstance(text, bytes) else str(text)

    def token_texts(self, ids, first=True):
        """Each token's text; `first`: the ids start a text, whose first
        space (SentencePiece's dummy prefix) is not part of it."""
        texts, pending, pending_at = [], b"", None
        for position, token in enumerate(ids):
            piece = self.vocabulary[int(token)]
            if int(token) in (self.start_token_id, self.end_token_id):
                texts.append("")  # not part of the decoded text
                continue
            if len(piece) == 6 and piece.startswith("<0x") and piece[-1] == ">":
                pending += bytes([int(piece[3:5], 16)])
                pending_at = position if pending_at is None else pending_at
                texts.append("")
                try:
                    char = pending.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                texts[-1], pending, pending_at = char, b"", None
                continue
            texts.append(piece.replace("\u2581", " "))
        if first:
            for i, text in enumerate(texts):
                if text:
                    if text.startswith(" "):
                        texts[i] = text[1:]
                    break
        return texts
