"""Streaming generation: `generate_stream` against `generate`, for
MultiHashFormer and the Standard baseline (KerasHub Qwen3) on the same trunk
and tokenizer, built and timed in turns in one run.

Batch 1, greedy, one fixed prompt, `--new-tokens` new tokens with
`stop_token_ids=None` (every call makes them all). After a first call of
each that compiles, `--repeats` rounds time, for each model in turn:

- `generate`: `lm.generate(prompt, max_new_tokens=N, stop_token_ids=None,
  strip_prompt=True)`; tokens/s = N / its wall time;
- the text stream: `"".join(lm.generate_stream(prompt, ...))` at the API's
  `chunk_size` (its text is checked against `generate`'s); tokens/s = N /
  the whole stream's wall time, and its time to the first non-empty piece
  (a piece may hold back half a character, so that first piece can come a
  call later than the first token);
- the same two on token ids (the preprocessor detached: the prompt packed
  as `generate` packs it), where the stream's first chunk holds exactly the
  first token: its arrival is the time to first token.

Every number is the best of the rounds. Ratios: stream tokens/s over
`generate`'s (the target is >= 0.8), and MHF over Standard.

Profile of the stream's per-chunk overhead: the token-id and text streams
again at several `--chunk-sizes` (the compiled calls do not change with
it), a least-squares fit of the token-id stream's time against its number
of compiled calls (slope: the fixed cost of one call; the rest: the
prompt's pass and the tokens), the time `TextPieces` (the text stream's
detokenizer) takes for the same ids replayed chunk by chunk, and the host
copy of the token ids.

    python -m benchmarks.streaming     # KERAS_BACKEND's; writes
        # benchmarks/results/streaming_<backend>.json and .md
    KERAS_BACKEND=torch python -m benchmarks.streaming
    python -m benchmarks.streaming --quick --output /tmp/s.json   # seconds
"""

import argparse
import contextlib
import math
import os
import time

from benchmarks import common
from benchmarks import result_tables

PROMPT = "The cell is the basic unit of life"
# The target of generate_stream: at least 0.8x generate's tokens/s.
TARGET = 0.8
QUICK = dict(
    architecture="tiny_h3b64",
    vocabulary_size=120,
    new_tokens=8,
    repeats=2,
    chunk_sizes=[2, 8],
    sweep_repeats=1,
)


# --- models -------------------------------------------------------------------


def build_models(args):
    """`{"mhf": ..., "standard": ...}`: a random MHF of `args.architecture`
    and the Standard baseline on its trunk, one tokenizer, the greedy
    sampler."""
    import keras

    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import MultiHashFormerTokenizer
    from keras_mhf.models import standard_causal_lm

    tokenizer = MultiHashFormerTokenizer(
        common.benchmark_sentencepiece(args.vocabulary_size)
    )
    length = 2 * (args.new_tokens + 64)
    keras.utils.set_random_seed(0)
    mhf = MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, args.architecture, sequence_length=length
    )
    keras.utils.set_random_seed(0)
    standard = standard_causal_lm(
        tokenizer, args.architecture.split("_")[0], sequence_length=length
    )
    models = {"mhf": mhf, "standard": standard}
    for lm in models.values():
        lm.compile(sampler="greedy")
    return models


@contextlib.contextmanager
def detached(lm):
    """`lm` without its preprocessor (token ids in and out)."""
    preprocessor = lm.preprocessor
    lm.preprocessor = None
    try:
        yield preprocessor
    finally:
        lm.preprocessor = preprocessor


def id_prompt(lm, new_tokens):
    """The prompt's ids packed as `generate` packs the text."""
    import numpy as np
    from keras import ops

    from keras_mhf.models.causal_lm_inputs import pack_text_prompts

    prompt, lengths = pack_text_prompts(
        lm.preprocessor, [PROMPT], max_new_tokens=new_tokens
    )
    return {k: np.asarray(ops.convert_to_numpy(v)) for k, v in prompt.items()}


# --- one call each ----------------------------------------------------------


def time_generate(lm, inputs, n):
    """`(seconds, output)` of one `generate` call."""
    start = time.perf_counter()
    out = lm.generate(
        inputs, max_new_tokens=n, stop_token_ids=None, strip_prompt=True
    )
    return time.perf_counter() - start, out


def time_text_stream(lm, n, chunk_size):
    """`(seconds, seconds to the first non-empty piece, text, pieces)`."""
    start = time.perf_counter()
    first, pieces = None, []
    for piece in lm.generate_stream(
        PROMPT, max_new_tokens=n, stop_token_ids=None, chunk_size=chunk_size
    ):
        if first is None and piece:
            first = time.perf_counter() - start
        pieces.append(piece)
    return time.perf_counter() - start, first, "".join(pieces), len(pieces)


def time_id_stream(lm, prompt, n, chunk_size):
    """`(seconds, seconds to the first chunk (one token), ids, chunks)`,
    `lm` detached."""
    import numpy as np

    start = time.perf_counter()
    first, ids, chunks = None, [], 0
    for new in lm.generate_stream(
        prompt, max_new_tokens=n, stop_token_ids=None, chunk_size=chunk_size
    ):
        if first is None:
            first = time.perf_counter() - start
        ids.extend(int(i) for i in new[0])
        chunks += 1
    return time.perf_counter() - start, first, np.asarray(ids), chunks


def compiled_calls(n, chunk_size):
    """The stream's compiled calls for `n` tokens (its `chunk_schedule`)."""
    from keras_mhf.models.generation_stream import chunk_schedule

    calls, made = 0, 0
    for steps in chunk_schedule(chunk_size):
        if made >= n:
            return calls
        calls, made = calls + 1, made + steps


# --- the profile ------------------------------------------------------------


def detokenize_seconds(preprocessor, ids, chunk_size, repeats=3):
    """Best time `TextPieces` takes to turn `ids` into pieces when pushed as
    the stream pushes them (its `chunk_schedule`), and its number of
    pushes."""
    from keras_mhf.models.generation_stream import TextPieces
    from keras_mhf.models.generation_stream import chunk_schedule

    bounds = [0]
    for steps in chunk_schedule(chunk_size):
        if bounds[-1] >= len(ids):
            break
        bounds.append(min(bounds[-1] + steps, len(ids)))
    best = math.inf
    for _ in range(repeats):
        pieces = TextPieces(preprocessor)
        start = time.perf_counter()
        for a, b in zip(bounds, bounds[1:]):
            pieces.push(ids[a:b])
        pieces.finish()
        best = min(best, time.perf_counter() - start)
    return best, len(bounds) - 1


def host_copy_microseconds(width, count=2000):
    """Mean microseconds of the stream's host copy of `[1, width]` int32
    token ids already computed (`np.asarray(ops.convert_to_numpy(x))`)."""
    import numpy as np
    from keras import ops

    x = ops.convert_to_tensor(np.zeros((1, width), "int32"))
    np.asarray(ops.convert_to_numpy(x))
    start = time.perf_counter()
    for _ in range(count):
        np.asarray(ops.convert_to_numpy(x))
    return 1e6 * (time.perf_counter() - start) / count


def variables_microseconds(lm, count=200):
    """Mean microseconds of reading the model's variable values (listed
    once), which the JAX stream passes to every compiled call (its
    `jax.jit` state)."""
    trainable = list(lm.trainable_variables)
    non_trainable = list(lm.non_trainable_variables)
    start = time.perf_counter()
    for _ in range(count):
        [v.value for v in trainable]
        [v.value for v in non_trainable]
    return 1e6 * (time.perf_counter() - start) / count


def fit_calls(rows, n):
    """Least squares of the token-id stream's seconds against its compiled
    calls over the chunk sizes: `(ms per call, ms of the rest)`."""
    import numpy as np

    calls = np.asarray([compiled_calls(n, r["chunk_size"]) for r in rows])
    seconds = np.asarray([r["id_stream_s"] for r in rows])
    if len(set(calls.tolist())) < 2:
        return None, None
    slope, intercept = np.polyfit(calls, seconds, 1)
    return 1000 * float(slope), 1000 * float(intercept)


# --- the run ----------------------------------------------------------------


def _best(old, new):
    return new if old is None or (new is not None and new < old) else old


def measure(models, args):
    """The table rows (one per model), the chunk-size sweep and the
    profile (see the module docstring)."""
    from keras_mhf.models.generation_stream import DEFAULT_CHUNK_SIZE
    from keras_mhf.utils.keras_utils import count_trainable_parameters

    n, chunk = args.new_tokens, DEFAULT_CHUNK_SIZE
    prompts = {name: id_prompt(lm, n) for name, lm in models.items()}
    texts, ids = {}, {}
    for name, lm in models.items():  # compile (and warm up) every path
        _, texts[name] = time_generate(lm, PROMPT, n)
        time_text_stream(lm, n, chunk)
        with detached(lm):
            time_generate(lm, prompts[name], n)
            time_id_stream(lm, prompts[name], n, chunk)
    best = {name: {} for name in models}
    keys = (
        "generate_s",
        "stream_s",
        "first_piece_s",
        "id_generate_s",
        "id_stream_s",
        "first_token_s",
    )
    for _ in range(args.repeats):
        for name, lm in models.items():
            got = {}
            got["generate_s"], text = time_generate(lm, PROMPT, n)
            stream_s, first, streamed, pieces = time_text_stream(lm, n, chunk)
            got.update(stream_s=stream_s, first_piece_s=first)
            with detached(lm):
                got["id_generate_s"], _ = time_generate(lm, prompts[name], n)
                stream_s, first, new_ids, chunks = time_id_stream(
                    lm, prompts[name], n, chunk
                )
            got.update(id_stream_s=stream_s, first_token_s=first)
            ids[name] = new_ids
            row = best[name]
            for key in keys:
                row[key] = _best(row.get(key), got[key])
            row["same_text"] = row.get("same_text", True) and (
                streamed == text == texts[name]
            )
            row.update(pieces=pieces, chunks=chunks, tokens=len(new_ids))
    rows = []
    for name, lm in models.items():
        r = best[name]
        rows.append(
            dict(
                model=name,
                parameters=count_trainable_parameters(lm),
                chunk_size=chunk,
                new_tokens=n,
                **{k: r[k] for k in keys},
                generate_tokens_per_s=n / r["generate_s"],
                stream_tokens_per_s=n / r["stream_s"],
                stream_ratio=r["generate_s"] / r["stream_s"],
                id_generate_tokens_per_s=n / r["id_generate_s"],
                id_stream_tokens_per_s=n / r["id_stream_s"],
                id_stream_ratio=r["id_generate_s"] / r["id_stream_s"],
                same_text=r["same_text"],
                tokens=r["tokens"],
                pieces=r["pieces"],
                chunks=r["chunks"],
            )
        )
    sweep = chunk_sweep(models, prompts, args)
    profile = {}
    for name, lm in models.items():
        mine = [r for r in sweep if r["model"] == name]
        per_call, rest = fit_calls(mine, n)
        detokenize, pushes = detokenize_seconds(
            lm.preprocessor, ids[name], chunk
        )
        width = prompts[name]["token_ids"].shape[1]
        row = next(r for r in rows if r["model"] == name)
        profile[name] = dict(
            per_call_ms=per_call,
            rest_ms=rest,
            generate_ms_per_token=1000 * row["id_generate_s"] / n,
            detokenize_ms=1000 * detokenize,
            detokenize_pushes=pushes,
            detokenize_ms_per_push=1000 * detokenize / pushes,
            host_copy_us=host_copy_microseconds(width),
            variables_us=variables_microseconds(lm),
            overhead_ms=1000 * (row["stream_s"] - row["generate_s"]),
            id_overhead_ms=1000 * (row["id_stream_s"] - row["id_generate_s"]),
        )
    return rows, sweep, profile


def chunk_sweep(models, prompts, args):
    """The token-id and text streams' best times at each chunk size."""
    n = args.new_tokens
    best = {}
    for _ in range(args.sweep_repeats):
        for chunk in args.chunk_sizes:
            for name, lm in models.items():
                text_s, _, _, _ = time_text_stream(lm, n, chunk)
                with detached(lm):
                    id_s, _, _, _ = time_id_stream(lm, prompts[name], n, chunk)
                row = best.setdefault(
                    (name, chunk),
                    dict(
                        model=name,
                        chunk_size=chunk,
                        calls=compiled_calls(n, chunk),
                    ),
                )
                row["stream_s"] = _best(row.get("stream_s"), text_s)
                row["id_stream_s"] = _best(row.get("id_stream_s"), id_s)
    rows = list(best.values())
    for r in rows:
        r["stream_tokens_per_s"] = n / r["stream_s"]
        r["id_stream_tokens_per_s"] = n / r["id_stream_s"]
    return rows


def mhf_over_standard(rows):
    """MHF's numbers over Standard's (tokens/s: > 1 is MHF faster; times:
    < 1 is MHF sooner)."""
    mhf = next(r for r in rows if r["model"] == "mhf")
    standard = next(r for r in rows if r["model"] == "standard")
    return {
        key: mhf[key] / standard[key]
        for key in (
            "generate_tokens_per_s",
            "stream_tokens_per_s",
            "first_token_s",
            "first_piece_s",
            "generate_s",
        )
        if mhf.get(key) and standard.get(key)
    }


def report(data):
    """The Markdown report of a run."""
    label = data["label"]
    lines = [
        f"# Streaming generation ({label})",
        "",
        result_tables.streaming_caption(data["settings"], data["backend"]),
        "",
        *result_tables.streaming_table(data["results"]),
        "",
        result_tables.streaming_summary(data),
        "",
        "Chunk sizes (best of the rounds; tokens/s of the whole stream):",
        "",
        *result_tables.streaming_chunk_table(data["chunk_sizes"]),
        "",
        "Per-chunk overhead:",
        "",
        *result_tables.streaming_profile_table(data["profile"]),
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    p = common.argument_parser(
        "streaming",
        __doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--backend-label",
        default=None,
        help="name of the run in the report and the output file "
        "(default: KERAS_BACKEND's backend)",
    )
    p.add_argument("--architecture", default="mini_h4b1024")
    p.add_argument(
        "--vocabulary-size",
        type=int,
        default=4000,
        help="SentencePiece pieces (above 120: trained on the OpenStax "
        "sample of tests/testdata)",
    )
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7, help="rounds (best of)")
    p.add_argument(
        "--sweep-repeats",
        type=int,
        default=3,
        help="rounds of the chunk-size sweep (best of)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="PyTorch's intra-op threads (torch.set_num_threads; 0: its "
        "default). On 2 cores shared with other jobs its default 2 threads "
        "ran generation 5-7x slower than 1",
    )
    p.add_argument(
        "--chunk-sizes",
        type=int,
        nargs="+",
        default=[1, 4, 8, 16, 32, 128],
        help="chunk sizes of the profile's sweep",
    )
    p.add_argument(
        "--output",
        default=None,
        help="JSON result (a .md beside it); default "
        "benchmarks/results/streaming_<label>.json",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny model and a few tokens: checks the tool runs (seconds)",
    )
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    import keras

    backend = keras.config.backend()
    label = args.backend_label or backend
    if backend != "torch":
        args.torch_threads = None
    elif args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    start = time.perf_counter()
    models = build_models(args)
    rows, sweep, profile = measure(models, args)
    settings = {k: v for k, v in vars(args).items() if k != "output"}
    settings.update(prompt=PROMPT, batch_size=1, sampler="greedy")
    data = {
        "backend": backend,
        "label": label,
        "settings": settings,
        "target": TARGET,
        "results": rows,
        "mhf_over_standard": mhf_over_standard(rows),
        "chunk_sizes": sweep,
        "profile": profile,
        "seconds": time.perf_counter() - start,
    }
    output = args.output or os.path.join(
        common.RESULTS, f"streaming_{label}.json"
    )
    common.write_json(output, data)
    text = report(data)
    with open(os.path.splitext(output)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
