"""The Markdown tables of the measurements in `benchmarks/results`: results
in (the JSON a benchmark script writes, or the rows it measured), Markdown
out.

The benchmark scripts write their reports (`benchmarks/results/*.md`, or the
text they print) with these functions, and `benchmarks.write_performance_docs`
builds the tables of docs/performance.md with the same ones, so each table's
columns and formulas live here once. This module is the tables;
`benchmarks/common.py` holds the rest the scripts share (paths, processes,
models, memory readers).

Only the standard library is used: the page writer imports this module
without keras.
"""

# --- shared ---


def markdown_table(header, rows):
    """The lines of a Markdown table: `header`, its rule, one line a row."""
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def by_kind(results, kind, vocabulary_size):
    """The result of `kind` at `vocabulary_size` (None if not measured)."""
    return next(
        (
            r
            for r in results
            if r.get("kind") == kind
            and r.get("vocabulary_size") == vocabulary_size
        ),
        None,
    )


# --- training: throughput, MFU, memory, generation (benchmarks.benchmark) ---


def _standard(results, r, vocabulary_size):
    """Standard's result on `r`'s backend at `vocabulary_size`."""
    return next(
        (
            s
            for s in results
            if s["backend"] == r["backend"]
            and s["vocabulary_size"] == vocabulary_size
            and s["config"] == "standard"
        ),
        None,
    )


def training_table(results, backend_column=True, step_range=True):
    """One row per (backend, V, model): training tok/s, MFU, peak training
    memory, generation ms/token at batch 1 / 8, scoring tok/s, analytic
    GFLOP/token, and an MHF's ratios to Standard at the same backend and V
    (generation: measured, the analytic FLOP ratio in brackets).
    `backend_column` and `step_range` (the fastest and slowest step, s) are
    the columns a one-backend summary leaves out."""
    header = [
        "V",
        "model",
        "train tok/s (min-max step s)" if step_range else "train tok/s",
        "MFU",
        "peak train MB",
        "gen ms/token b1 / b8",
        "score tok/s",
        "GFLOP/token",
        "MHF/Std tok/s",
        "MHF/Std MFU",
        "MHF/Std memory",
        "MHF/Std gen b1 / b8 (analytic)",
    ]
    rows = []
    for r in results:
        std = _standard(results, r, r["vocabulary_size"])
        ratios = ["", "", "", ""]
        if std is not None and r["config"] != "standard":
            memory = r["peak_train_memory_mb"] / max(
                std["peak_train_memory_mb"], 1e-9
            )
            generate = [
                r[f"generate_ms_per_token_b{b}"]
                / std[f"generate_ms_per_token_b{b}"]
                for b in (1, 8)
            ]
            generate_flops = (
                r["generate_flops_per_token"] / std["generate_flops_per_token"]
            )
            ratios = [
                f"{r['train_tokens_per_s'] / std['train_tokens_per_s']:.2f}",
                f"{r['mfu'] / std['mfu']:.2f}",
                f"{memory:.2f}",
                f"{generate[0]:.2f} / {generate[1]:.2f} ({generate_flops:.2f})",
            ]
        speed = f"{r['train_tokens_per_s']:,.0f}"
        if step_range:
            speed += (
                f" ({r['train_step_min_s']:.2f}-{r['train_step_max_s']:.2f})"
            )
        row = [
            f"{r['vocabulary_size']:,}",
            r["config"],
            speed,
            f"{r['mfu']:.2f}",
            f"{r['peak_train_memory_mb']:,.0f}",
            f"{r['generate_ms_per_token_b1']:.1f} / "
            f"{r['generate_ms_per_token_b8']:.1f}",
            f"{r['score_tokens_per_s']:,.0f}",
            f"{r['flops_per_token'] / 1e9:.3f}",
        ]
        rows.append(([r["backend"]] if backend_column else []) + row + ratios)
    if backend_column:
        header = ["backend"] + header
    return markdown_table(header, rows)


def paper_scale_costs(results):
    """`(result, FLOP ratio, MFU ratio)` for each MHF at V = 32,768 with a
    Standard there on its backend: its analytic training FLOPs per token at
    the paper's 1B trunk over Standard's, and Standard's MFU over its own.
    Their product carries the measured per-FLOP efficiency over to the
    paper's training time (time per token = FLOPs / (MFU x peak))."""
    costs = []
    for r in results:
        std = _standard(results, r, 32768)
        if (
            std is None
            or r["config"] == "standard"
            or r["vocabulary_size"] != 32768
        ):
            continue
        flops = r["flops_per_token_paper_1b"] / std["flops_per_token_paper_1b"]
        costs.append((r, flops, std["mfu"] / r["mfu"]))
    return costs


def training_report(results, peaks):
    """`benchmarks.benchmark`'s report: the table, the peak matmul FLOP/s of
    each backend and the extrapolation to the paper's 1B trunk."""
    lines = training_table(results)
    peak_line = ", ".join(
        f"{b}: {p / 1e9:.0f} GFLOP/s" for b, p in peaks.items()
    )
    lines += ["", f"Peak 2048x2048 float32 matmul: {peak_line}.", ""]
    for r, flops, efficiency in paper_scale_costs(results):
        lines.append(
            "Extrapolated training cost at the paper's 1B trunk (V=32K, "
            f"context 2048), {r['backend']} {r['config']}: {flops:.2f}x "
            f"Standard's FLOPs x {efficiency:.2f} (Standard/MHF MFU) = "
            f"{flops * efficiency:.2f}x Standard's time."
        )
    return "\n".join(lines) + "\n"


# --- inference against V (benchmarks.benchmark --inference ...) ---

SCORING_HEADER = [
    "V",
    "MHF score tok/s",
    "Standard score tok/s",
    "MHF / Standard",
    "analytic FLOP ratio",
    "measured / analytic",
]


def scoring_rows(results, emphasize=False):
    """`--inference scoring`: MHF's and Standard's scoring tok/s per V, their
    ratio, the analytic FLOP ratio (Standard's forward FLOPs over MHF's) and
    measured over analytic; `emphasize` bolds the ratios of 1 or more."""
    rows = []
    for v in sorted({r["vocabulary_size"] for r in results}):
        m = by_kind(results, "mhf_score", v)
        s = by_kind(results, "standard_score", v)
        if m is None or s is None:
            continue
        if "error" in s:
            rows.append(
                [
                    f"{v:,}",
                    f"{m['score_tokens_per_s']:,.0f}",
                    s["error"],
                    "—",
                    "—",
                    "—",
                ]
            )
            continue
        ratio = m["score_tokens_per_s"] / s["score_tokens_per_s"]
        analytic = s["forward_flops_per_token"] / m["forward_flops_per_token"]
        shown = f"{ratio:.2f}"
        if emphasize and ratio >= 1:
            shown = f"**{shown}**"
        rows.append(
            [
                f"{v:,}",
                f"{m['score_tokens_per_s']:,.0f}",
                f"{s['score_tokens_per_s']:,.0f}",
                shown,
                f"{analytic:.2f}",
                f"{ratio / analytic:.2f}",
            ]
        )
    return rows


def scoring_report(results):
    return "\n".join(markdown_table(SCORING_HEADER, scoring_rows(results)))


FALLBACK_HEADER = [
    "V",
    "K",
    "candidates ms/token b1 / b8",
    "full scan b1 / b8",
    "candidates / full b1 / b8",
    "fallback rate b1 / b8",
]


def fallback_rows(results, vocab):
    """`--inference fallback`: candidate decoding whose every step falls back
    to the full scan against `decoding="full"` on the same model, per V."""
    rows = []
    for v in vocab:
        r = by_kind(results, "mhf_disagree", v)
        c = [r[f"disagree_candidates_ms_per_token_b{b}"] for b in (1, 8)]
        f = [r[f"disagree_full_ms_per_token_b{b}"] for b in (1, 8)]
        rate = [r[f"disagree_candidates_fallback_rate_b{b}"] for b in (1, 8)]
        rows.append(
            [
                f"{v:,}",
                r["candidate_buckets"],
                f"{c[0]:.1f} / {c[1]:.1f}",
                f"{f[0]:.1f} / {f[1]:.1f}",
                f"{c[0] / f[0]:.2f} / {c[1] / f[1]:.2f}",
                f"{rate[0]:.3f} / {rate[1]:.3f}",
            ]
        )
    return rows


def fallback_report(results, settings, scale):
    """The all-fallback table under what was measured (`settings`: the
    benchmark's options; `scale`: the factor on the bucket tables)."""
    lines = [
        f"Every certificate fails (a random {settings['mhf_architecture']} "
        f"whose bucket tables are scaled x{scale:g}, so its heads disagree; "
        f"greedy, {settings['new_tokens']} new tokens per call; after a "
        "failure the next 1, 2, 4, ... steps scan without searching; "
        "fallback rate: the steps that scanned):",
        "",
    ]
    lines += markdown_table(
        FALLBACK_HEADER, fallback_rows(results, settings["vocab"])
    )
    return "\n".join(lines)


VOCABULARY_HEADER = [
    "V",
    "MHF candidates ms/token b1 / b8",
    "MHF full scan b1 / b8",
    "Standard b1 / b8",
    "Standard / MHF candidates b1 / b8",
    "fallback rate b1 / b8",
    "MHF score tok/s",
    "Standard score tok/s",
    "MHF / Standard score",
]


def vocabulary_rows(results, vocab):
    """`--inference vocabulary`: generation ms/token (MHF with candidate
    decoding and with the full scan, Standard), candidate decoding's fallback
    rate and scoring tok/s, per V; a Standard run that failed shows why."""
    rows = []
    for v in vocab:
        m, s = by_kind(results, "mhf", v), by_kind(results, "standard", v)
        mc = [m[f"mhf_candidates_ms_per_token_b{b}"] for b in (1, 8)]
        mf = [m[f"mhf_full_ms_per_token_b{b}"] for b in (1, 8)]
        rate = [m[f"mhf_candidates_fallback_rate_b{b}"] for b in (1, 8)]
        row = [
            f"{v:,}",
            f"{mc[0]:.1f} / {mc[1]:.1f}",
            f"{mf[0]:.1f} / {mf[1]:.1f}",
        ]
        if "error" in s:
            row += [s["error"], "—"]
        else:
            sg = [s[f"standard_ms_per_token_b{b}"] for b in (1, 8)]
            row += [
                f"{sg[0]:.1f} / {sg[1]:.1f}",
                f"{sg[0] / mc[0]:.2f} / {sg[1] / mc[1]:.2f}",
            ]
        row += [
            f"{rate[0]:.3f} / {rate[1]:.3f}",
            f"{m['mhf_score_tokens_per_s']:,.0f}",
        ]
        if "error" in s:
            row += ["—", "—"]
        elif "score_error" in s:
            row += [s["score_error"], "—"]
        else:
            score = s["standard_score_tokens_per_s"]
            row += [
                f"{score:,.0f}",
                f"{m['mhf_score_tokens_per_s'] / score:.2f}",
            ]
        rows.append(row)
    return rows


def candidate_slowdown(results, vocab):
    """`{V: [batch 1, batch 8]}`: MHF's candidate decoding time per token at
    each V over its time at the smallest V."""
    base = by_kind(results, "mhf", min(vocab))
    return {
        v: [
            by_kind(results, "mhf", v)[key] / base[key]
            for key in (f"mhf_candidates_ms_per_token_b{b}" for b in (1, 8))
        ]
        for v in vocab
    }


def vocabulary_report(results, settings, scale):
    """The vocabulary table, each V's candidate decoding time against the
    smallest V's, the all-fallback table (`fallback_report`) and an
    untrained model's fallback rate."""
    vocab = settings["vocab"]
    lines = markdown_table(VOCABULARY_HEADER, vocabulary_rows(results, vocab))
    for v, ratios in candidate_slowdown(results, vocab).items():
        for b, ratio in zip((1, 8), ratios):
            lines.append(
                f"\nMHF at V={v:,}, batch {b}: {ratio:.2f}x its time per "
                f"token at V={min(vocab):,}."
            )
    lines.append("\n" + fallback_report(results, settings, scale))
    random = by_kind(results, "mhf_random", min(vocab))
    lines.append(
        f"\nFallback rate of an untrained model of the same architecture "
        f"(V={min(vocab):,}): "
        f"{random['mhf_candidates_fallback_rate_b1']:.3f} (batch 1), "
        f"{random['mhf_candidates_fallback_rate_b8']:.3f} (batch 8)."
    )
    return "\n".join(lines)


QUANTIZATION_HEADER = [
    "model",
    "weights",
    "gen ms/token b1",
    "gen ms/token b8",
    "vocabulary-side bytes",
    "speed-up b1 vs float32",
]


def quantization_rows(results, settings):
    """`--inference quantization`: generation ms/token and the vocabulary
    side's bytes of each model in float32 and each quantized mode, at the
    smallest V of `settings`."""
    v = min(settings["vocab"])
    rows = []
    for config in settings["configs"]:
        base = by_kind(results, f"{config}:float32", v)
        for mode in ["float32"] + list(settings["quantize"]):
            r = by_kind(results, f"{config}:{mode}", v)
            speedup = base["gen_ms_per_token_b1"] / r["gen_ms_per_token_b1"]
            rows.append(
                [
                    config,
                    mode,
                    f"{r['gen_ms_per_token_b1']:.1f}",
                    f"{r['gen_ms_per_token_b8']:.1f}",
                    f"{r['table_bytes']:,}",
                    f"{speedup:.2f}x",
                ]
            )
    return rows


def quantization_report(results, settings):
    lines = markdown_table(
        QUANTIZATION_HEADER, quantization_rows(results, settings)
    )
    v = min(settings["vocab"])
    mhf_config = next(c for c in settings["configs"] if c != "standard")
    for mode in settings["quantize"]:
        mhf = by_kind(results, f"{mhf_config}:{mode}", v)
        std = by_kind(results, f"standard:{mode}", v)
        lines.append(
            f"\n{mode}: MHF / Standard time per token at batch 1: "
            f"{mhf['gen_ms_per_token_b1'] / std['gen_ms_per_token_b1']:.2f}x."
        )
    return "\n".join(lines)


# --- training memory (benchmarks.head_memory) ---

# The headless rows (a backbone under a mean squared loss on its hidden
# states): the base of the "head's share" of the MHF rows and of Standard's.
TRUNKS = ("trunk", "standard_trunk")


def head_memory_table(rows, xla_analysis=False):
    """`benchmarks.head_memory`'s table of its measured `rows` (one a mode and
    tokens per step): peak RSS growth (or, with `xla_analysis`, XLA's
    temporaries), the ratio to Standard at the same tokens, the head's share
    (over the headless row's), and the step time and loss (or XLA's argument
    sizes). A row that failed shows why."""
    if xla_analysis:
        lines = [
            "| head | tokens/step | temporaries MiB | / Standard | head's "
            "share MiB | arguments MiB |",
            "|---|---|---|---|---|---|",
        ]
        value, columns = "xla_temp_mib", ("xla_argument_mib",)
    else:
        lines = [
            "| head | tokens/step | peak MiB | / Standard | head's share MiB "
            "| step s | loss |",
            "|---|---|---|---|---|---|---|",
        ]
        value, columns = "peak_mib", ("step_s", "loss")
    by_mode = {(r["mode"], r["tokens"]): r for r in rows if not r.get("failed")}
    for r in rows:
        if r.get("failed"):
            blanks = " |" * (len(columns) + 2)
            lines.append(
                f"| {r['mode']} | {r['tokens']} | {r['failed']} |{blanks}"
            )
            continue
        std = by_mode.get(("standard", r["tokens"]))
        ratio = f"{r[value] / std[value]:.2f}" if std and std[value] > 0 else ""
        headless = "standard_trunk" if r["mode"] == "standard" else "trunk"
        base = by_mode.get((headless, r["tokens"]))
        share = (
            f"{r[value] - base[value]:.0f}"
            if base and r["mode"] not in TRUNKS
            else ""
        )
        rest = " | ".join(
            f"{r[c]:.4f}"
            if c == "loss"
            else f"{r[c]:.0f}"
            if "mib" in c
            else f"{r[c]:.2f}"
            for c in columns
        )
        lines.append(
            f"| {r['mode']} | {r['tokens']} | {r[value]:.0f} | {ratio} "
            f"| {share} | {rest} |"
        )
    return lines


def read_markdown_table(path):
    """The rows of the first Markdown table in the file at `path` (e.g. one
    `head_memory_table` wrote), as dicts from its header to the cells'
    text."""
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip().startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append(dict(zip(header, cells)))
    return rows


# --- gradient accumulation's memory (benchmarks.accumulation_memory) ---

ACCUMULATION_HEADER = [
    "batch",
    "N",
    "micro-batch",
    "step peak MB",
    "/ batch 8, N 1",
    "first chunk peak MB",
    "total peak MB",
    "weights MB",
    "AdamW state MB",
    "accumulators MB",
]


def accumulation_memory_rows(rows):
    """The rows of `benchmarks.accumulation_memory`'s table: per `(batch,
    N)`, the step's peak RSS growth and its ratio, the first chunk's
    (compiling included), the process's peak, the state's sizes and, where
    measured, XLA's temporaries; a row that failed shows why."""
    xla = any("xla_temp_mb" in r for r in rows)
    table = []
    for r in rows:
        if r.get("failed"):
            blanks = [""] * (len(ACCUMULATION_HEADER) - 4 + xla)
            table.append(
                [r["batch"], r["micro_batches"], "", r["failed"], *blanks]
            )
            continue
        ratio = r.get("ratio")
        cells = [
            r["batch"],
            r["micro_batches"],
            r["micro_batch"],
            f"{r['step_peak_mb']:,.0f}",
            f"**{ratio:.2f}**" if ratio is not None else "",
            f"{r['first_chunk_peak_mb']:,.0f}",
            f"{r['total_peak_mb']:,.0f}",
            f"{r['weights_mb']:.1f}",
            f"{r['optimizer_state_mb']:.1f}",
            f"{r['accumulators_mb']:.1f}",
        ]
        if xla:
            cells.append(
                f"{r['xla_temp_mb']:,.0f}" if "xla_temp_mb" in r else ""
            )
        table.append(cells)
    return table


def accumulation_memory_table(rows):
    """`benchmarks.accumulation_memory`'s Markdown table of its `rows`."""
    header = list(ACCUMULATION_HEADER)
    if any("xla_temp_mb" in r for r in rows):
        header.append("XLA temporaries MB")
    return markdown_table(header, accumulation_memory_rows(rows))


def accumulation_memory_caption(settings, backend):
    """What `benchmarks.accumulation_memory`'s table measured (its
    `settings`, on `backend`)."""
    flag = {
        "jax": "; XLA flag `--xla_cpu_enable_concurrency_optimized_"
        "scheduler=false`",
        "torch": "; `MALLOC_MMAP_THRESHOLD_=65536`",
    }.get(backend, "")
    xla = (
        " XLA temporaries: the compiled train step's buffers for one "
        "micro-batch (activations, gradients)."
        if backend == "jax"
        else ""
    )
    return (
        f"`{settings['architecture']}` (float32, blocks not rematerialised), "
        f"sequence {settings['sequence_length']}, a run's model, optimizer "
        "and loader (`build_run_model`, `train_chunk`), each row in a fresh "
        "process; batch = windows per optimizer step, N = micro-batches per "
        "step. Step peak: peak RSS growth over the built model during "
        f"{settings['steps']} optimizer step"
        + ("s" if settings["steps"] != 1 else "")
        + " after a first one (the peak mark reset in between); first "
        "chunk: the same for that first step (compiling included, on JAX); "
        "total: the process's peak RSS. "
        "Ratio: step peak over the batch-8, N-1 row's, measured in the same "
        f"run (target for batch 64, N 8: <= 1.15). Weights, AdamW state and "
        f"accumulators: their variables' bytes.{xla} CPU, 2 shared cores"
        f"{flag}."
    )


def accumulation_memory_summary(rows):
    """One sentence on `benchmarks.accumulation_memory`'s `rows`: each
    accumulated row's ratio, and the accumulators against the base row's
    step peak."""
    done = [r for r in rows if not r.get("failed") and "ratio" in r]
    base = next((r for r in done if r["ratio"] == 1.0), None)
    if base is None:
        return ""
    parts = [
        f"batch {r['batch']} in {r['micro_batches']} micro-batch"
        + ("es" if r["micro_batches"] > 1 else "")
        + f" takes {r['ratio']:.2f}x the step memory of batch {base['batch']}"
        for r in done
        if r is not base
    ]
    accumulated = [r for r in done if r["accumulators_mb"] > 0]
    text = "; ".join(parts) + "." if parts else ""
    if parts:
        text = text[0].upper() + text[1:]
    if accumulated:
        r = accumulated[0]
        text += (
            f" The accumulators (one float32 copy of the trainable weights) "
            f"are {r['accumulators_mb']:.1f} MB, "
            f"{r['accumulators_mb'] / base['step_peak_mb']:.1%} of batch "
            f"{base['batch']}'s step peak."
        )
    return text.strip()


# --- quantization quality (benchmarks.quantization_quality) ---

QUALITY_HEADER = [
    "model",
    "weights",
    "next-token acc",
    "perplexity (paper rule)",
    "perplexity (calibrated)",
    "ECE",
    "greedy identical",
]


def quality_modes(results):
    """float32, then the quantized modes measured against it."""
    return ["float32"] + [
        mode
        for mode, r in results.items()
        if isinstance(r, dict) and "greedy_identical" in r
    ]


def quality_rows(results, label):
    """Held-out next-token accuracy, perplexity (paper rule and calibrated)
    and ECE of float32 and each quantized mode (with their changes), and
    the share of greedy continuations identical to float32's; `label` names
    the model in its first row."""
    rows = []
    for mode in quality_modes(results):
        r = results[mode]
        accuracy = f"{r['accuracy']:.4f}"
        perplexity = f"{r['perplexity']:,.2f}"
        identical = ""
        if mode != "float32":
            accuracy += f" ({r['accuracy_change_points']:+.2f} pt)"
            perplexity += f" ({r['perplexity_change']:+.2%})"
            identical = f"{r['greedy_identical']:.0%}"
        rows.append(
            [
                label if mode == "float32" else "",
                mode,
                accuracy,
                f"{r.get('paper_rule', r)['perplexity']:,.1f}",
                perplexity,
                f"{r['ece']:.3f}",
                identical,
            ]
        )
    return rows


def quality_report(results, label, prompts, new_tokens):
    """The quality table and a sentence per quantized mode."""
    lines = markdown_table(QUALITY_HEADER, quality_rows(results, label))
    for mode in quality_modes(results)[1:]:
        r = results[mode]
        lines.append(
            f"\n{mode}: next-token accuracy "
            f"{r['accuracy_change_points']:+.2f} points, held-out perplexity "
            f"ratio (calibrated) {r['perplexity_ratio']:.4f} "
            f"({r['perplexity_change']:+.2%}), greedy continuations "
            f"identical for {r['greedy_identical']:.0%} of {prompts} prompts "
            f"({new_tokens} new tokens each)."
        )
    return "\n".join(lines)


# --- evaluation (benchmarks.benchmark_evaluation, evaluation_at_scale) ---

EVALUATION_TASKS = {"lambada": "LAMBADA-style", "piqa": "PIQA-style"}


def evaluation_speed_table(results):
    """`benchmarks.benchmark_evaluation`: the compiled scorer's examples/s
    (first pass, with compiling, and second) against the eager `score()`
    path, and how far their log-likelihoods and greedy flags agree."""
    rows = []
    for task, label in EVALUATION_TASKS.items():
        r = results[task]
        rows.append(
            [
                label,
                f"{r['reference_examples_per_s']:.2f}",
                f"{r['compiled_examples_per_s_first_pass']:.2f}",
                f"{r['compiled_examples_per_s']:.2f}",
                f"{r['speedup']:.1f}x ({r['speedup_first_pass']:.1f}x)",
                f"{r['max_loglikelihood_difference']:.1e}",
                "yes" if r["same_greedy_flags"] else "no",
            ]
        )
    return markdown_table(
        [
            "task",
            "eager score() ex/s",
            "compiled ex/s (first pass, with compiling)",
            "compiled ex/s",
            "speed-up (first pass)",
            "max log-likelihood difference",
            "same greedy flags",
        ],
        rows,
    )


def evaluation_speed_report(results, vocabulary_size):
    s = results["settings"]
    return "\n".join(
        [
            f"Evaluation speed, {results['backend']}, {s['architecture']}, "
            f"V={vocabulary_size:,}, batch {s['batch_size']}",
            "",
            *evaluation_speed_table(results),
        ]
    )


def evaluation_parts_table(report):
    """`benchmarks.evaluation_at_scale`: wall time and peak RSS of each part of
    the run (the interrupted one, the resumed one)."""
    return markdown_table(
        [
            "part",
            "wall s",
            "peak RSS MB (largest process so far)",
            "examples recorded",
        ],
        [
            [
                p["part"],
                f"{p['seconds']:.0f}",
                f"{p['peak_rss_mb']:,.0f}",
                p.get("examples_recorded", "all"),
            ]
            for p in report["parts"]
        ],
    )


def evaluation_at_scale_report(report):
    """The parts table, the totals and the metrics of each task."""
    metrics = []
    for key, m in report["metrics"].items():
        other = m.get("acc_norm", m.get("perplexity"))
        metrics.append([key, m["examples"], f"{m['acc']:.4f}", f"{other:.4f}"])
    lines = [
        f"Evaluation at scale: {report['preset']}, batch "
        f"{report['batch_size']}",
        "",
        *evaluation_parts_table(report),
        "",
        f"Total {report['total_seconds']:.0f} s, peak RSS "
        f"{report['peak_rss_mb']:,.0f} MB. {report['compiled_shapes']}",
        "",
        *markdown_table(
            ["task", "examples", "acc", "acc_norm / perplexity"], metrics
        ),
    ]
    return "\n".join(lines)


# --- data pipeline (benchmarks.benchmark_data) ---


def prepare_table(prepare):
    """Tokenizing into shards: text and shard sizes, tokens, workers,
    seconds and tokens/s of each run on each corpus."""
    rows = []
    for name in ("small", "large"):
        part = prepare.get(name, {})
        for run in part.get("runs", []):
            rows.append(
                [
                    name,
                    f"{part['text_bytes'] / 1e6:,.0f} MB",
                    f"{run['tokens']:,}",
                    f"{run['shard_bytes'] / 1e6:,.0f} MB",
                    run["workers"],
                    run["seconds"],
                    f"{run['tokens_per_s']:,}",
                ]
            )
    return markdown_table(
        [
            "corpus",
            "text",
            "tokens",
            "shards",
            "workers",
            "seconds",
            "tokens/s",
        ],
        rows,
    )


def _met(ok):
    return "met" if ok else "NOT met"


# How `formats_table` names the formats of `benchmark_data`'s formats
# section.
FORMAT_NAMES = {
    "jsonl": "JSONL",
    "jsonl.zst": "JSONL, zstandard",
    "parquet": "Parquet (FineWeb-Edu columns)",
    "save_to_disk": "`datasets` save_to_disk (Arrow)",
}


def formats_table(formats):
    """`DocumentReader` over the same text in each published format: MB/s
    of document text, documents/s and the input's size."""
    jsonl = formats["formats"]["jsonl"]["megabytes_per_s"]
    rows = [
        [
            FORMAT_NAMES.get(name, name),
            f"{rate['input_bytes'] / 1e6:,.1f} MB",
            f"{rate['megabytes_per_s']:,.1f}",
            f"{rate['documents_per_s']:,}",
            f"{rate['megabytes_per_s'] / jsonl:.2f}x",
        ]
        for name, rate in formats["formats"].items()
    ]
    return markdown_table(
        ["format", "input", "text MB/s", "documents/s", "vs JSONL"], rows
    )


def formats_summary(formats):
    """One sentence: what was read and Parquet's rate against JSONL's."""
    return (
        f"The same {formats['documents']:,} OpenStax documents "
        f"({formats['text_bytes'] / 1e6:,.1f} MB of text) read by "
        "`DocumentReader` in each format (Parquet: row groups of "
        f"{formats['row_group_rows']} rows, only the text column read), the "
        f"best of {formats['passes']} passes each: Parquet reads "
        f"{formats['parquet_over_jsonl']:.2f}x as fast as JSONL (target "
        f"{formats['target']:g}x: {_met(formats['met'])})."
    )


def data_report(results, rss_limit_mb, loader_factor):
    """`benchmarks.benchmark_data`'s report of the sections in `results`
    (`rss_limit_mb`, `loader_factor`: the targets the rss and loader
    sections were held to)."""
    lines = [
        "# Streaming data path: measurements",
        "",
        f"Machine: {results.get('machine', '?')}."
        + (f" {results['note']}" if results.get("note") else ""),
        "",
    ]
    if results.get("prepare"):
        lines += prepare_table(results["prepare"]) + [""]
    reader = results.get("reader")
    if reader:
        lines += [
            f"`prepare_data`'s main process reads and parses "
            f"{reader['megabytes_per_s']} MB/s of JSONL "
            f"({reader['documents_per_s']:,} documents/s), the ceiling that "
            "more tokenizer workers cannot pass.",
            "",
        ]
    formats = results.get("formats")
    if formats:
        lines += formats_table(formats) + ["", formats_summary(formats), ""]
    rss = results.get("rss")
    if rss:
        lines += [
            f"Peak RSS of `keras-mhf pretrain` ({rss['architecture']}, "
            f"{rss['steps']} steps, backend {rss['backend']}): small corpus "
            f"{rss['small']['peak_rss_mb']} MB, large corpus "
            f"{rss['large']['peak_rss_mb']} MB, difference "
            f"{rss['difference_mb']} MB (limit {rss_limit_mb} MB: "
            f"{_met(rss['met'])}).",
            "",
        ]
    loader = results.get("loader")
    if loader:
        lines += [
            f"Loader: {loader['loader']['windows_per_s']:,} windows/s "
            f"({loader['loader']['tokens_per_s']:,} tokens/s, sequence 128, "
            f"batch 8); {loader['model']['architecture']} trains "
            f"{loader['model']['tokens_per_s']:,} tokens/s "
            f"({loader['model']['backend']}): the loader delivers "
            f"{loader['factor']:,.0f}x (target {loader_factor}x: "
            f"{_met(loader['met'])}).",
            "",
        ]
    resume = results.get("resume")
    if resume:
        lines += [
            f"Resume on the large corpus: process start to the end of the "
            f"first training step {resume['resumed_run_s']} s after a SIGKILL "
            f"(a fresh run: {resume['fresh_run_s']} s; starting Python and "
            f"importing keras_mhf.pretraining alone: {resume['import_s']} s; "
            f"target {resume['target_s']} s: {_met(resume['met'])}).",
            "",
        ]
    tests = results.get("tests")
    if tests:
        lines += markdown_table(
            ["backend", f"`{' '.join(tests['files'])}`", "result"],
            [
                [backend, f"{run['seconds']} s", run["result"]]
                for backend, run in tests["backends"].items()
            ],
        )
        lines.append("")
    return "\n".join(lines)

# --- streaming generation (benchmarks.streaming) ---

STREAMING_MODELS = {"mhf": "MHF", "standard": "Standard"}

STREAMING_HEADER = [
    "model",
    "`generate` tok/s",
    "stream tok/s",
    "stream / `generate`",
    "first token ms",
    "first piece ms",
    "`generate` ms (whole answer)",
    "ids: `generate` tok/s",
    "ids: stream tok/s",
    "ids: stream / `generate`",
]


def _ms(seconds):
    return "—" if seconds is None else f"{1000 * seconds:,.1f}"


def streaming_rows(results, target=0.8):
    """The rows of `benchmarks.streaming`'s table: per model, `generate`'s
    and the text stream's tokens/s and their ratio (bold when it meets
    `target`), the time to the first token (token-id stream) and to the
    first non-empty text piece, `generate`'s time for the whole answer, and
    the token-id `generate` and stream."""
    rows = []
    for r in results:
        ratio = f"{r['stream_ratio']:.2f}x"
        if r["stream_ratio"] >= target:
            ratio = f"**{ratio}**"
        rows.append(
            [
                STREAMING_MODELS.get(r["model"], r["model"]),
                f"{r['generate_tokens_per_s']:,.0f}",
                f"{r['stream_tokens_per_s']:,.0f}",
                ratio,
                _ms(r["first_token_s"]),
                _ms(r["first_piece_s"]),
                _ms(r["generate_s"]),
                f"{r['id_generate_tokens_per_s']:,.0f}",
                f"{r['id_stream_tokens_per_s']:,.0f}",
                f"{r['id_stream_ratio']:.2f}x",
            ]
        )
    return rows


def streaming_table(results, target=0.8):
    """`benchmarks.streaming`'s Markdown table of its `results`."""
    return markdown_table(STREAMING_HEADER, streaming_rows(results, target))


def streaming_caption(settings, backend):
    """What `benchmarks.streaming`'s table measured (its `settings`, on
    `backend`)."""
    how = {
        "jax": "`generate` one `jax.jit` call, the stream one per chunk",
        "tensorflow": "`tf.function` calls",
        "torch": "eager, both",
    }.get(backend, "")
    threads = settings.get("torch_threads")
    if backend == "torch" and threads:
        how += (
            f"; {threads} intra-op thread"
            + ("s" if threads != 1 else "")
            + " (`torch.set_num_threads`)"
        )
    return (
        f"`{settings['architecture']}` and Standard on its trunk (random "
        f"weights, float32), a {settings['vocabulary_size']:,}-piece "
        f"SentencePiece tokenizer; batch 1, greedy, the prompt "
        f'"{settings["prompt"]}", {settings["new_tokens"]} new tokens '
        "(`stop_token_ids=None`), the stream at its default `chunk_size` "
        f"({how}); best of {settings['repeats']} rounds, the two models "
        "timed in turns after a compiling call of each. Text: "
        '`generate(prompt, strip_prompt=True)` and `"".join(generate_stream'
        "(prompt))`, whose texts are the same; ids: the same prompt packed "
        "as token ids, the preprocessor detached. First token: when the "
        "token-id stream's first chunk (one token) arrives; first piece: "
        "when the text stream's first non-empty piece does (a piece holds "
        "back half a character, so it may come a chunk later). Target: "
        "stream >= 0.8x `generate`. CPU, 2 shared cores."
    )


def streaming_summary(data):
    """Sentences on a `benchmarks.streaming` run: each model's stream
    ratio against the target, and MHF over Standard."""
    target = data.get("target", 0.8)
    parts = []
    for r in data["results"]:
        met = "meets" if r["stream_ratio"] >= target else "misses"
        parts.append(
            f"{STREAMING_MODELS.get(r['model'], r['model'])}'s stream "
            f"makes {r['stream_ratio']:.2f}x `generate`'s tokens/s "
            f"({met} the {target}x target; on token ids "
            f"{r['id_stream_ratio']:.2f}x), its first token after "
            f"{_ms(r['first_token_s'])} ms against "
            f"{_ms(r['generate_s'])} ms for `generate`'s whole answer"
        )
    text = "; ".join(parts) + "."
    ratios = data.get("mhf_over_standard", {})
    if ratios:
        text += (
            " MHF / Standard: `generate` tokens/s "
            f"{ratios['generate_tokens_per_s']:.2f}x, stream tokens/s "
            f"{ratios['stream_tokens_per_s']:.2f}x, time to first token "
            f"{ratios['first_token_s']:.2f}x."
        )
    same = all(r.get("same_text") for r in data["results"])
    text += (
        " The streamed text was `generate`'s in every round."
        if same
        else " The streamed text differed from `generate`'s."
    )
    return text


def streaming_chunk_table(sweep):
    """Tokens/s of the text and token-id streams at each chunk size (and
    the compiled calls it takes), one row per chunk size, a column pair per
    model."""
    models = list(dict.fromkeys(r["model"] for r in sweep))
    header = ["chunk_size", "compiled calls"]
    for m in models:
        name = STREAMING_MODELS.get(m, m)
        header += [f"{name} text tok/s", f"{name} ids tok/s"]
    rows = []
    for chunk in sorted({r["chunk_size"] for r in sweep}):
        mine = {r["model"]: r for r in sweep if r["chunk_size"] == chunk}
        row = [chunk, next(iter(mine.values()))["calls"]]
        for m in models:
            r = mine.get(m)
            row += (
                [
                    f"{r['stream_tokens_per_s']:,.0f}",
                    f"{r['id_stream_tokens_per_s']:,.0f}",
                ]
                if r
                else ["", ""]
            )
        rows.append(row)
    return markdown_table(header, rows)


def streaming_profile_table(profile):
    """Where the stream's time beyond `generate`'s goes, per model: the
    extra ms (text and ids), the fitted fixed cost of a compiled call,
    `generate`'s ms per token, `TextPieces`' ms (in all and per push) and
    the host copy of the ids."""
    header = [
        "model",
        "stream - `generate` ms (text)",
        "(ids)",
        "ms per compiled call (fit)",
        "`generate` ms per token",
        "`TextPieces` ms (pushes)",
        "ms per push",
        "host copy µs",
        "variable values µs",
    ]
    rows = []
    for model, p in profile.items():
        per_call = p.get("per_call_ms")
        rows.append(
            [
                STREAMING_MODELS.get(model, model),
                f"{p['overhead_ms']:.1f}",
                f"{p['id_overhead_ms']:.1f}",
                "—" if per_call is None else f"{per_call:.2f}",
                f"{p['generate_ms_per_token']:.2f}",
                f"{p['detokenize_ms']:.1f} ({p['detokenize_pushes']})",
                f"{p['detokenize_ms_per_push']:.2f}",
                f"{p['host_copy_us']:.0f}",
                f"{p['variables_us']:.0f}",
            ]
        )
    return markdown_table(header, rows)


# --- serving (benchmarks.serving) ---

SERVING_MODELS = {"mhf": "MHF", "standard": "Standard"}

SERVING_HEADER = [
    "model",
    "1 client tok/s",
    "1 client first chunk ms",
    "8 clients tok/s",
    "8 clients mean first chunk ms",
    "8 / 1",
    "batches (rows)",
]


def serving_caption(settings, backend):
    """What `benchmarks.serving`'s table measured (its `settings`, on
    `backend`)."""
    threads = settings.get("torch_threads")
    torch = (
        f"; the PyTorch servers with {threads} intra-op thread"
        + ("s" if threads != 1 else "")
        if backend == "torch" and threads
        else ""
    )
    clients = settings["clients"]
    return (
        f"`{settings['architecture']}` and Standard on its trunk (random "
        f"weights, float32), a {settings['vocabulary_size']:,}-piece "
        "SentencePiece tokenizer, each saved as a preset and served by "
        "`keras-mhf serve` (its own process, `--max-batch-size "
        f"{settings['max_batch_size']} --batch-wait-ms "
        f"{settings['batch_wait_ms']:g} --chunk-size "
        f"{settings['chunk_size']}`) on 127.0.0.1, talked to with the "
        "`openai` client: streamed completions (`stream=True`), greedy "
        f"(`temperature=0`), `max_tokens={settings['max_tokens']}`. 1 "
        "client: one stream alone, tokens/s = its completion tokens (the "
        "usage chunk's) / its wall time; first chunk: from the request to "
        f"the first streamed chunk. {clients} clients: {clients} threads, "
        "each its own prompt, released together; tokens/s = all their "
        "completion tokens / the wall time from the first request to the "
        "last stream's end. Batches (rows): how many generations the "
        f"{clients} requests ran as (`/health`'s counters). Best of "
        f"{settings['repeats']} rounds, the models in turns after a warm-up "
        f"request of each shape. Target: {clients} / 1 >= 3x. CPU, 2 "
        f"shared cores (server and clients){torch}."
    )


def serving_rows(results, target=3.0):
    """The rows of `benchmarks.serving`'s table: per model, one client's
    and the concurrent clients' tokens/s and first chunk, their ratio (bold
    when it meets `target`), and the batches the concurrent requests ran
    as."""
    rows = []
    for r in results:
        ratio = f"{r['batching_ratio']:.2f}x"
        if r["batching_ratio"] >= target:
            ratio = f"**{ratio}**"
        rows.append(
            [
                SERVING_MODELS.get(r["model"], r["model"]),
                f"{r['single_tokens_per_s']:,.0f}",
                f"{1000 * r['single_first_chunk_s']:,.0f}",
                f"{r['concurrent_tokens_per_s']:,.0f}",
                f"{1000 * r['concurrent_first_chunk_s']:,.0f}",
                ratio,
                f"{r['batches']} ({r['batched_rows']})",
            ]
        )
    return rows


def serving_table(results, target=3.0, backend=None):
    """`benchmarks.serving`'s table (a backend column first when `backend`
    is given)."""
    header, rows = SERVING_HEADER, serving_rows(results, target)
    if backend is not None:
        header = ["backend", *header]
        rows = [[backend, *row] for row in rows]
    return markdown_table(header, rows)


def serving_summary(data):
    """A sentence per model on the batching ratio against the target, the
    MHF / Standard ratios, and whether every completion had `max_tokens`
    tokens."""
    target = data["target"]
    parts = []
    for r in data["results"]:
        name = SERVING_MODELS.get(r["model"], r["model"])
        verdict = "meets" if r["batching_ratio"] >= target else "misses"
        parts.append(
            f"{name}: {data['settings']['clients']} clients make "
            f"{r['batching_ratio']:.2f}x one client's tokens/s "
            f"({verdict} the {target:g}x target), in "
            f"{r['batches']} batch"
            + ("es" if r["batches"] != 1 else "")
            + f" of {r['batched_rows']} rows."
        )
    ratios = data.get("mhf_over_standard") or {}
    if ratios:
        parts.append(
            "MHF / Standard: 1 client tokens/s "
            f"{ratios.get('single_tokens_per_s', 0):.2f}x, "
            f"{data['settings']['clients']} clients tokens/s "
            f"{ratios.get('concurrent_tokens_per_s', 0):.2f}x, time to "
            f"first chunk {ratios.get('single_first_chunk_s', 0):.2f}x."
        )
    short = [
        SERVING_MODELS.get(r["model"], r["model"])
        for r in data["results"]
        if not r.get("full_length", True)
    ]
    if short:
        parts.append(
            f"Some completions of {', '.join(short)} ended before "
            f"max_tokens (`</s>`); tokens/s count the tokens made."
        )
    else:
        parts.append(
            f"Every completion had its {data['settings']['max_tokens']} tokens."
        )
    return " ".join(parts)
