"""MultiHashFormer vs the Standard baseline (KerasHub Qwen3), measured side
by side in one run: training throughput, peak training memory, generation
latency per token with the KV cache (median of 3 calls), scoring throughput,
analytic FLOPs per token, model-FLOPs utilisation and MHF/Standard ratios.

    python -m benchmarks.benchmark          # jax; V = 32K, 128K, 256K
    python -m benchmarks.benchmark --backends jax tensorflow torch --vocab 32768
    python -m benchmarks.benchmark --hidden-dim 256 --num-layers 8
    python -m benchmarks.benchmark --smoke  # seconds; CI runs this
    python -m benchmarks.benchmark --compare before.json after.json
    python -m benchmarks.benchmark --inference vocabulary --mhf-preset PRESET \
        --vocab 32768 1048576 4194304   # decode/score cost against V
    python -m benchmarks.benchmark --inference quantization   # int8 vs float32
    python -m benchmarks.benchmark --inference scoring --mhf-preset PRESET \
        --vocab 32768 131072 1048576   # score(loss) against Standard
    python -m benchmarks.benchmark --paper-shape --backends jax tensorflow \
        torch --vocab 32768 262144   # training memory at the 100M shape

Every (backend, vocabulary, model) is measured in its own subprocess, so peak
memory (peak RSS growth over the process after imports) is per model. Model
FLOPs utilisation = achieved training FLOP/s / the peak FLOP/s of a compiled
2048x2048 float32 matmul on the same backend in the same run. Vocabularies
beyond the tokenizer's use synthetic token strings (`tok0`, `tok1`, ...).
"""

import argparse
import json
import os
import time

import numpy as np

from benchmarks import common
from benchmarks import result_tables

CONFIGS = {"standard": None, "h3b10624": (3, 10624), "h4b16384": (4, 16384)}


def parse_args(argv=None):
    p = common.argument_parser(
        "benchmark",
        __doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backends", nargs="+", default=["jax"])
    p.add_argument(
        "--vocab", nargs="+", type=int, default=[32768, 131072, 262144]
    )
    p.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        help="standard and/or h<H>b<B> hash configurations",
    )
    p.add_argument("--hidden-dim", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--sequence-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--steps", type=int, default=10, help="timed training steps (median)"
    )
    p.add_argument(
        "--new-tokens", type=int, default=32, help="generated tokens timed"
    )
    p.add_argument("--output", default="benchmark.json")
    p.add_argument(
        "--inference",
        choices=["vocabulary", "fallback", "quantization", "scoring"],
        default=None,
        help="inference benchmarks: generation (KV cache, ms/token, batch 1 "
        "and 8) and loss scoring against the vocabulary size for a trained "
        "MHF expanded with synthetic tokens (candidate and full decoding, "
        "fallback rates) and the Standard baseline on the same trunk; "
        "fallback: candidate decoding when every step falls back (a random "
        "MHF whose bucket tables are scaled x30, so the heads disagree) "
        "against the full scan; or float32 against quantized models",
    )
    p.add_argument(
        "--mhf-preset",
        default=None,
        help="--inference vocabulary: a trained MHF preset whose trunk and "
        "weights are measured (its vocabulary is grown with synthetic "
        "tokens); default: a random mini_h4b16k",
    )
    p.add_argument(
        "--mhf-architecture",
        default="mini_h4b16k",
        help="--inference vocabulary without --mhf-preset: the random MHF",
    )
    p.add_argument(
        "--quantize",
        nargs="+",
        default=["int8"],
        help="--inference quantization: modes compared with float32",
    )
    p.add_argument(
        "--paper-shape",
        action="store_true",
        help="training at the paper's 100M trunk (12 x 768, 12/2 heads, MLP "
        "2560), sequence 1024, --paper-tokens tokens per step, blocks "
        "rematerialised: peak memory and step time of MHF H4B16384 and "
        "H3B10624 (fused head) against Standard, a fresh process per model "
        "(benchmarks.head_memory); writes OUTPUT_<backend>_v<V>.md",
    )
    p.add_argument("--paper-tokens", nargs="+", type=int, default=[8192])
    p.add_argument(
        "--rounds",
        type=int,
        default=7,
        help="--inference scoring: timed calls of each model, MHF and "
        "Standard in turns in one process (median)",
    )
    p.add_argument("--inference-worker", nargs=3, help=argparse.SUPPRESS)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, the workers in this process: checks the tool runs",
    )
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("BEFORE", "AFTER"),
        help="print a before/after table of two JSON outputs and exit",
    )
    p.add_argument(
        "--worker",
        nargs=3,
        metavar=("BACKEND", "VOCAB", "CONFIG"),
        help=argparse.SUPPRESS,
    )
    return p.parse_args(argv)


def trunk_kwargs(args):
    return common.trunk_kwargs(args.hidden_dim, args.num_layers)


def build(config, vocabulary_size, args):
    return common.benchmark_model(config, vocabulary_size, trunk_kwargs(args))


def worker(backend, vocabulary_size, config, args):
    """Measures one model; prints one JSON line."""
    import keras

    from keras_mhf.utils.keras_utils import count_trainable_parameters

    baseline = common.current_rss_bytes()
    b, s = args.batch_size, args.sequence_length
    x, y = common.random_batch(vocabulary_size, b, s)
    sw = np.ones((b, s), "float32")
    model = build(config, vocabulary_size, args)
    for _ in range(2):  # compile and warm up
        model.train_on_batch(x, y, sample_weight=sw)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        model.train_on_batch(x, y, sample_weight=sw)
        times.append(time.perf_counter() - start)
    peak = (common.peak_rss_bytes() - baseline) / 2**20
    step = float(np.median(times))
    result = {
        "backend": backend,
        "vocabulary_size": vocabulary_size,
        "config": config,
        "train_step_s": step,
        "train_step_min_s": float(min(times)),
        "train_step_max_s": float(max(times)),
        "train_tokens_per_s": b * s / step,
        "peak_train_memory_mb": peak,
        "flops_per_token": common.flops_per_token(
            config, vocabulary_size, trunk_kwargs(args), args.sequence_length
        ),
        "parameters": count_trainable_parameters(model),
    }
    result["achieved_flops"] = (
        result["flops_per_token"] * result["train_tokens_per_s"]
    )

    # Generation latency per new token, with the KV cache, batch 1 and 8.
    prompt_length = 16
    for batch in (1, 8):
        prompt = common.generation_prompt(
            batch,
            prompt_length,
            args.new_tokens,
            x["token_ids"][0, :prompt_length],
        )
        model.generate(prompt, stop_token_ids=None)  # compile
        latencies = []
        for _ in range(3):
            start = time.perf_counter()
            model.generate(prompt, stop_token_ids=None)
            latencies.append(
                1000 * (time.perf_counter() - start) / args.new_tokens
            )
        result[f"generate_ms_per_token_b{batch}"] = float(np.median(latencies))
    # The same model at the paper's 1B trunk (V=32K, 2048-token context), for
    # the extrapolated training-cost ratio in the table.
    result["flops_per_token_paper_1b"] = common.flops_per_token(
        config, 32768, common.paper_trunk("1b"), 2048
    )
    result["generate_flops_per_token"] = common.flops_per_token(
        config,
        vocabulary_size,
        trunk_kwargs(args),
        prompt_length + args.new_tokens // 2,
        factor=2,
    )

    # Scoring throughput (token log-probs over the whole vocabulary).
    model.score(x["token_ids"], x["padding_mask"])
    start = time.perf_counter()
    np.asarray(
        keras.ops.convert_to_numpy(
            model.score(x["token_ids"], x["padding_mask"])
        )
    )
    result["score_tokens_per_s"] = b * s / (time.perf_counter() - start)
    common.print_result(result)


def peak_matmul(backend, size=2048, repeats=20):
    """FLOP/s of a compiled float32 matmul on this backend."""
    a = np.random.default_rng(0).normal(size=(size, size)).astype("float32")
    if backend == "jax":
        import jax

        f = jax.jit(lambda x: x @ x)
        x = jax.numpy.asarray(a)
        f(x).block_until_ready()
        start = time.perf_counter()
        for _ in range(repeats):
            f(x).block_until_ready()
    elif backend == "tensorflow":
        import tensorflow as tf

        f = tf.function(lambda x: tf.matmul(x, x), jit_compile=True)
        x = tf.constant(a)
        f(x).numpy()
        start = time.perf_counter()
        for _ in range(repeats):
            f(x).numpy()
    else:
        import torch

        x = torch.from_numpy(a)
        torch.matmul(x, x)
        start = time.perf_counter()
        for _ in range(repeats):
            torch.matmul(x, x)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def _options(args, *names):
    """The `--name value` options of `args`' `names`, for a worker."""
    options = []
    for name in names:
        options += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return options


# `--smoke` runs the workers in this process (`_worker`): its numbers mean
# nothing, and a new process per worker would be most of its time.
IN_PROCESS = False


def _worker(*args, env=None):
    """Runs this module as a worker: the finished process (`returncode`,
    `stdout`, `stderr`, as text). A worker runs in a new process, so that
    its time and memory are its own, except under `--smoke`, whose workers
    of this process's backend run here (`IN_PROCESS`)."""
    backend = (env or os.environ).get("KERAS_BACKEND")
    if not (IN_PROCESS and backend in (None, os.environ.get("KERAS_BACKEND"))):
        return common.run_module(
            "benchmark", *args, env=env, capture_output=True, text=True
        )
    import contextlib
    import io
    import subprocess
    import traceback

    out, err, status = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else 1
        except Exception:  # reported as a worker's failure, as a process's
            traceback.print_exc()
            status = 1
    return subprocess.CompletedProcess(
        args, status, out.getvalue(), err.getvalue()
    )


def run(args):
    results, peaks = [], {}
    passthrough = _options(
        args,
        "hidden_dim",
        "num_layers",
        "sequence_length",
        "batch_size",
        "steps",
        "new_tokens",
    )
    for backend in args.backends:
        env = dict(os.environ, KERAS_BACKEND=backend)
        done = _worker("--worker", backend, "0", "matmul", env=env)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        peaks[backend] = common.results_in(done.stdout)[-1]["peak_flops"]
        for vocabulary_size in args.vocab:
            for config in args.configs:
                started = time.time()
                done = _worker(
                    "--worker",
                    backend,
                    vocabulary_size,
                    config,
                    *passthrough,
                    env=env,
                )
                if done.returncode != 0:
                    raise RuntimeError(
                        f"{backend} V={vocabulary_size} {config}:\n"
                        + done.stderr[-3000:]
                    )
                result = common.results_in(done.stdout)[-1]
                result["mfu"] = result["achieved_flops"] / peaks[backend]
                result["peak_matmul_flops"] = peaks[backend]
                results.append(result)
                print(
                    f"  {backend:<10} V={vocabulary_size:<7} {config:<9} "
                    f"{result['train_tokens_per_s']:>9.0f} tok/s  "
                    f"MFU {result['mfu']:.2f}  "
                    f"({time.time() - started:.0f} s)",
                    flush=True,
                )
    return results, peaks


def compare(before_path, after_path):
    """Before/after table of two runs (same backend, vocabularies, models)."""
    with open(before_path) as f:
        before = {
            (r["backend"], r["vocabulary_size"], r["config"]): r
            for r in json.load(f)["results"]
        }
    with open(after_path) as f:
        after = json.load(f)["results"]
    lines = [
        "| backend | V | model | train tok/s | MFU | gen ms/token b1 | "
        "gen ms/token b8 | peak train MB | score tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in after:
        old = before.get((r["backend"], r["vocabulary_size"], r["config"]))
        if old is None:
            continue
        cells = [
            f"{old[k]:{fmt}} -> {r[k]:{fmt}}"
            for k, fmt in (
                ("train_tokens_per_s", ",.0f"),
                ("mfu", ".2f"),
                ("generate_ms_per_token_b1", ".1f"),
                ("generate_ms_per_token_b8", ".1f"),
                ("peak_train_memory_mb", ",.0f"),
                ("score_tokens_per_s", ",.0f"),
            )
        ]
        lines.append(
            f"| {r['backend']} | {r['vocabulary_size']:,} | {r['config']} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def run_paper_shape(args):
    """`--paper-shape`: `benchmarks.head_memory` per backend and vocabulary
    (`--smoke`: the tiny trunk, 64 tokens per step, sequence 32)."""
    stem = os.path.splitext(os.path.abspath(args.output))[0]
    trunk, tokens, sequence, modes = (
        ("tiny", [64], 32, ["fused", "standard"])
        if args.smoke
        else (
            "100m",
            args.paper_tokens,
            1024,
            ["fused", "fused_h3", "standard"],
        )
    )
    for backend in args.backends:
        for vocabulary_size in args.vocab:
            out = f"{stem}_{backend}_v{vocabulary_size}.md"
            command = [
                "--trunk",
                trunk,
                "--rematerialize",
                "--sequence-length",
                str(sequence),
                "--tokens",
                *map(str, tokens),
                "--vocab",
                str(vocabulary_size),
                "--modes",
                *modes,
                "--out",
                out,
            ]
            env = dict(os.environ, KERAS_BACKEND=backend)
            common.run_module("head_memory", *command, env=env, check=True)
            print(f"Wrote {out}.")


def main(argv=None):
    global IN_PROCESS
    args = parse_args(argv)
    IN_PROCESS = IN_PROCESS or args.smoke
    if args.compare:
        print(compare(*args.compare))
        return
    if args.smoke and args.inference in ("vocabulary", "fallback"):
        args.vocab, args.mhf_architecture, args.new_tokens = (
            [512],
            "tiny_h3b64",
            4,
        )
    elif args.smoke and args.inference == "scoring":
        args.vocab, args.mhf_architecture = [512], "tiny_h3b64"
        args.rounds = 2
    elif args.smoke and args.inference == "quantization":
        args.vocab, args.configs = [512], ["h3b64", "standard"]
        args.hidden_dim, args.num_layers, args.new_tokens = 64, 2, 4
    elif args.smoke:
        args.vocab, args.configs = [512], ["standard", "h3b64"]
        args.hidden_dim, args.num_layers, args.sequence_length = 64, 2, 16
        args.batch_size, args.steps, args.new_tokens = 2, 2, 4
    if args.paper_shape:
        run_paper_shape(args)
        return
    if args.inference_worker:
        _, kind, vocabulary_size = args.inference_worker
        inference_worker(kind, int(vocabulary_size), args)
        return
    if args.inference:
        started = time.time()
        results = run_inference(args)
        stem = os.path.splitext(args.output)[0]
        if args.inference == "vocabulary":
            report = vocabulary_report(results, args, stem + ".png")
        elif args.inference == "fallback":
            report = result_tables.fallback_report(
                results, vars(args), DISAGREE_SCALE
            )
        elif args.inference == "scoring":
            report = result_tables.scoring_report(results)
        else:
            report = result_tables.quantization_report(results, vars(args))
        print("\n" + report)
        common.write_json(
            args.output,
            {
                "settings": vars(args),
                "results": results,
                "seconds": time.time() - started,
            },
        )
        with open(stem + ".md", "w") as f:
            f.write(report + "\n")
        print(f"Wrote {args.output} ({time.time() - started:.0f} s).")
        return
    if args.worker:
        backend, vocabulary_size, config = args.worker
        if config == "matmul":
            common.print_result({"peak_flops": peak_matmul(backend)})
        else:
            worker(backend, int(vocabulary_size), config, args)
        return
    started = time.time()
    results, peaks = run(args)
    report = result_tables.training_report(results, peaks)
    print("\n" + report)
    common.write_json(
        args.output,
        {
            "settings": {k: v for k, v in vars(args).items() if k != "worker"},
            "peak_matmul_flops": peaks,
            "results": results,
            "seconds": time.time() - started,
        },
    )
    print(f"Wrote {args.output} ({time.time() - started:.0f} s).")


# --- Inference benchmarks (--inference) -----------------------------------


def _mhf_for_vocabulary(args, vocabulary_size):
    """The measured MHF at `vocabulary_size`: the preset's weights with its
    vocabulary grown by synthetic tokens (no new parameters), or a random
    `mini_h4b16k` on synthetic tokens."""
    from keras_mhf.models import MultiHashFormerCausalLM

    if args.mhf_preset is None:
        return common.synthetic_mhf(vocabulary_size, args.mhf_architecture)
    model = MultiHashFormerCausalLM.from_preset(args.mhf_preset)
    vocabulary = model.preprocessor.tokenizer.get_vocabulary()
    if vocabulary_size > len(vocabulary):
        model = model.expand_vocabulary(
            new_tokens=common.synthetic_expansion(vocabulary, vocabulary_size)
        )
    model.preprocessor = None
    return model


def _trunk_of(model):
    b = model.backbone
    return dict(
        num_layers=b.num_layers,
        hidden_dim=b.hidden_dim,
        num_query_heads=b.num_query_heads,
        num_key_value_heads=b.num_key_value_heads,
        head_dim=b.head_dim,
        intermediate_dim=b.intermediate_dim,
    )


def _generation(model, prefix, new_tokens):
    result = {}
    for batch in (1, 8):
        if hasattr(model, "decoding_statistics"):
            model.decoding_statistics.reset()
        result[f"{prefix}_ms_per_token_b{batch}"] = (
            common.generation_ms_per_token(model, batch, new_tokens=new_tokens)
        )
        statistics = getattr(model, "decoding_statistics", None)
        if statistics is not None and model.decoding == "candidates":
            result[f"{prefix}_fallback_rate_b{batch}"] = (
                statistics.fallback_rate
            )
    return result


# The bucket tables of the random model are scaled by this, so that its
# heads are confident and disagree: every candidate-decoding step falls back.
DISAGREE_SCALE = 30.0


def _all_fallback(args, vocabulary_size):
    """Candidate decoding when every step falls back, against the full scan
    of the same model: a random `--mhf-architecture` MHF (the preset's trunk
    with `--mhf-preset`) whose bucket tables are scaled by `DISAGREE_SCALE`,
    `K` set explicitly (the automatic choice would scan small vocabularies
    whole). The two decodings are measured in turns, so a change in the
    machine's load between them does not show as a difference."""
    import keras

    architecture = args.mhf_architecture
    trunk = {}
    if args.mhf_preset is not None:
        model = _mhf_for_vocabulary(args, 32768)
        config = model.backbone.get_config()
        architecture = f"tiny_h{config['num_hashes']}b{config['num_buckets']}"
        trunk = _trunk_of(model)

    def disagreeing_model(decoding):
        model = common.synthetic_mhf(vocabulary_size, architecture, **trunk)
        for table in model.backbone.hash_encoder.embeddings:
            table.assign(keras.ops.convert_to_numpy(table) * DISAGREE_SCALE)
        model.compile(sampler="greedy")
        from keras_mhf.models.multi_hash_former.multi_hash_former_decoding import (  # noqa: E501
            resolved_candidate_buckets,
        )

        model.candidate_buckets = resolved_candidate_buckets(model)
        model.decoding = decoding
        return model

    # One model per decoding (the same weights), measured in turns.
    models = {d: disagreeing_model(d) for d in ("candidates", "full")}
    result = {"candidate_buckets": models["candidates"].candidate_buckets}
    for batch in (1, 8):
        models["candidates"].decoding_statistics.reset()
        times = common.interleaved_generation_ms_per_token(
            models, batch, new_tokens=args.new_tokens
        )
        for decoding, ms in times.items():
            result[f"disagree_{decoding}_ms_per_token_b{batch}"] = ms
        result[f"disagree_candidates_fallback_rate_b{batch}"] = models[
            "candidates"
        ].decoding_statistics.fallback_rate
    return result


def _scoring(args, vocabulary_size, with_standard):
    """`score(..., scoring_mode="loss")` throughput of the MHF at
    `vocabulary_size` (as `--inference vocabulary` builds it) and, with
    `with_standard`, of Standard on its trunk, the two timed in turns in
    this process (`--rounds` calls each, median): on 2 shared cores, one
    process per model read 0.88x to 2.13x for one ratio. Each with the
    analytic forward FLOPs per token of the model (trunk and head; the MHF
    vocabulary scan's additions are not FLOPs of a matmul and are left
    out, as the README's generation ratio does). Returns the result
    fields of `mhf_score` and, if measured, `standard_score`."""
    mhf = _mhf_for_vocabulary(args, vocabulary_size)
    trunk = _trunk_of(mhf)
    backbone = mhf.backbone
    models = {
        "mhf_score": (mhf, f"h{backbone.num_hashes}b{backbone.num_buckets}")
    }
    if with_standard:
        standard = common.synthetic_standard(vocabulary_size, "tiny", **trunk)
        models["standard_score"] = (standard, "standard")
    speeds = common.interleaved_scoring_tokens_per_s(
        {kind: model for kind, (model, _) in models.items()},
        vocabulary_size,
        rounds=args.rounds,
    )
    return {
        kind: {
            "config": config,
            "score_tokens_per_s": speeds[kind],
            "forward_flops_per_token": common.flops_per_token(
                config, vocabulary_size, dict(trunk), 128, factor=2
            ),
            "rounds": args.rounds,
        }
        for kind, (_, config) in models.items()
    }


def inference_worker(kind, vocabulary_size, args):
    """Measures one model of an inference benchmark; prints one JSON line."""
    result = {"kind": kind, "vocabulary_size": vocabulary_size}
    if kind in ("score_pair", "mhf_score"):
        measured = _scoring(args, vocabulary_size, kind == "score_pair")
        for name, fields in measured.items():  # one line per model
            line = {"kind": name, "vocabulary_size": vocabulary_size}
            common.print_result({**line, **fields})
        return
    elif kind == "mhf_disagree":
        result.update(_all_fallback(args, vocabulary_size))
    elif kind in ("mhf", "mhf_random"):
        model = _mhf_for_vocabulary(args, vocabulary_size)
        if kind == "mhf_random":  # same architecture, untrained weights
            config = model.backbone.get_config()
            model = common.synthetic_mhf(
                vocabulary_size,
                f"tiny_h{config['num_hashes']}b{config['num_buckets']}",
                **_trunk_of(model),
            )
        model.compile(sampler="greedy")
        # Set explicitly, so the search runs at every V (automatic K scans
        # small vocabularies whole, which is faster there).
        from keras_mhf.models.multi_hash_former.multi_hash_former_decoding import (  # noqa: E501
            resolved_candidate_buckets,
        )

        model.candidate_buckets = resolved_candidate_buckets(model)
        result["candidate_buckets"] = model.candidate_buckets
        result["max_bucket_load"] = list(model.bucket_index.max_bucket_load)
        for decoding in ("candidates", "full"):
            model.decoding = decoding
            result.update(
                _generation(model, f"mhf_{decoding}", args.new_tokens)
            )
            if kind == "mhf_random":
                break
        if kind == "mhf":
            result["mhf_score_tokens_per_s"] = common.scoring_tokens_per_s(
                model, vocabulary_size
            )
    elif kind == "standard":
        trunk = _trunk_of(_mhf_for_vocabulary(args, 32768))
        model = common.synthetic_standard(vocabulary_size, "tiny", **trunk)
        model.compile(sampler="greedy")
        result.update(_generation(model, "standard", args.new_tokens))
        # Partial result first: scoring forms [b, s, V] and may not fit.
        common.print_result(result)
        result["standard_score_tokens_per_s"] = common.scoring_tokens_per_s(
            model, vocabulary_size
        )
    else:  # quantization: "<config>:<mode>"
        config, mode = kind.split(":")
        model = build(config, vocabulary_size, args)
        if mode != "float32":
            model.quantize(mode)
        model.compile(sampler="greedy")
        if hasattr(model, "decoding"):
            model.decoding = "full"  # a random model: compare table reads
        result.update(_generation(model, "gen", args.new_tokens))
        result["table_bytes"] = common.weight_bytes(model)["vocabulary"]
    common.print_result(result)


def run_inference(args):
    jobs = []
    if args.inference == "vocabulary":
        for vocabulary_size in args.vocab:
            jobs += [("mhf", vocabulary_size), ("standard", vocabulary_size)]
        jobs.append(("mhf_random", min(args.vocab)))
    if args.inference in ("vocabulary", "fallback"):
        jobs += [("mhf_disagree", v) for v in args.vocab]
    if args.inference == "scoring":
        jobs += [("score_pair", v) for v in args.vocab]
    if args.inference == "quantization":
        for config in args.configs:
            for mode in ["float32"] + list(args.quantize):
                jobs.append((f"{config}:{mode}", min(args.vocab)))
    passthrough = _options(
        args,
        "hidden_dim",
        "num_layers",
        "mhf_architecture",
        "new_tokens",
        "rounds",
    )
    if args.mhf_preset:  # a folder: found from the workers' directory too
        preset = args.mhf_preset
        if os.path.exists(preset):
            preset = os.path.abspath(preset)
        passthrough += ["--mhf-preset", preset]
    results = []
    jobs.reverse()
    while jobs:
        kind, vocabulary_size = jobs.pop()
        started = time.time()
        done = _worker(
            "--inference-worker",
            args.inference,
            kind,
            vocabulary_size,
            *passthrough,
        )
        if done.returncode != 0 and kind in ("standard", "score_pair"):
            # The Standard baseline at the largest vocabularies may not fit
            # in memory (its embedding is V x d); the report says so.
            why = (
                "killed (out of memory)"
                if done.returncode in (-9, 137)
                else f"exit status {done.returncode}: {done.stderr[-300:]}"
            )
            if kind == "score_pair":  # the MHF alone, in a new process
                jobs.append(("mhf_score", vocabulary_size))
                result = {"kind": "standard_score", "error": why}
            elif common.results_in(done.stdout):  # generation was measured
                result = common.results_in(done.stdout)[-1]
                result["score_error"] = why
            else:
                result = {"kind": kind, "error": why}
            results.append({"vocabulary_size": vocabulary_size, **result})
            print(f"  {kind:<18} V={vocabulary_size:<8} {why}", flush=True)
            continue
        if done.returncode != 0:
            raise RuntimeError(
                f"{kind} V={vocabulary_size}:\n{done.stderr[-3000:]}"
            )
        found = common.results_in(done.stdout)
        if kind not in ("score_pair", "mhf_score"):
            found = found[-1:]  # a partial result may precede the whole
        for result in found:
            results.append(result)
            print(
                f"  {result['kind']:<18} V={vocabulary_size:<8} "
                f"({time.time() - started:.0f} s) {result}",
                flush=True,
            )
    return results


def vocabulary_report(results, args, png_path):
    """The vocabulary report (`result_tables.vocabulary_report`) and, where
    matplotlib is installed, ms per generated token against V plotted to
    `png_path`."""
    report = result_tables.vocabulary_report(
        results, vars(args), DISAGREE_SCALE
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return report
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, batch in zip(axes, (1, 8)):
        for label, kind, key in (
            ("MHF, candidate decoding", "mhf", "mhf_candidates"),
            ("MHF, full scan", "mhf", "mhf_full"),
            ("Standard (Qwen3)", "standard", "standard"),
        ):
            field = f"{key}_ms_per_token_b{batch}"
            points = [
                (v, result_tables.by_kind(results, kind, v).get(field))
                for v in args.vocab
            ]
            points = [(v, t) for v, t in points if t is not None]
            axis.plot(*zip(*points), "o-", label=label)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("vocabulary size V")
        axis.set_ylabel("ms per generated token")
        axis.set_title(f"batch {batch}")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return report + f"\n\nPlot: {os.path.basename(png_path)}."


if __name__ == "__main__":
    main()
