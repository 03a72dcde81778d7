"""Evaluation at benchmark scale: `keras-mhf evaluate` on task files the
size of LAMBADA (OpenAI, 5,153 passages), PIQA validation (1,838), ARC-Easy
test (2,376) and COPA (100), with wall time, peak memory and a resumed
interruption measured.

    python -m benchmarks.evaluation_at_scale \
        --preset runs/quickstart/mhf/preset
    python -m benchmarks.evaluation_at_scale --preset P \
        --lambada lambada_test.jsonl \
        --multiple-choice piqa.jsonl arc_easy.jsonl copa.jsonl   # real sets

The real sets cannot be downloaded here, so by default the four files are
written from the openstax training text (`../shared/data`) with the real
sets' sizes and shapes: LAMBADA-style passages of 40-120 words whose last
word is the target; PIQA-style an 8-word goal with two 20-word solutions
(its own continuation and another paragraph's); ARC-style a 22-word question
with four 4-word answers; COPA-style a 6-word premise with two 6-word
alternatives. Speed and memory depend on the number and lengths of the
requests, not on what the text says.

The evaluation runs in a fresh process (`keras-mhf evaluate --output`),
killed with SIGKILL after `--interrupt-after` seconds and started again on
the same output, which resumes; the report gives each part's wall time and
peak RSS, the number of compiled scoring shapes, and the metrics. Writes
`--report` (.json and .md).
"""

import argparse
import json
import os
import random
import signal
import subprocess
import time

from benchmarks import common
from benchmarks import result_tables

# Examples in the real sets.
SIZES = {"lambada": 5153, "piqa": 1838, "arc_easy": 2376, "copa": 100}


def parse_args(argv=None):
    p = common.argument_parser(
        "evaluation_at_scale",
        __doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", required=True)
    p.add_argument(
        "--work-dir",
        default=os.path.join(common.ROOT, "runs", "evaluation_at_scale"),
    )
    p.add_argument("--lambada", nargs="*", default=None)
    p.add_argument("--multiple-choice", nargs="*", default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--interrupt-after",
        type=float,
        default=120.0,
        help="seconds before the first run is killed (0: not interrupted)",
    )
    p.add_argument(
        "--report",
        default=os.path.join(common.RESULTS, "evaluation_at_scale"),
    )
    return p.parse_args(argv)


def paragraphs():
    from keras_mhf.data import read_documents

    for path in common.openstax_training_files():
        for doc in read_documents(path):
            for paragraph in doc.split("\n"):
                words = paragraph.split()
                if len(words) >= 45:
                    yield words


def alphabetic(word):
    return word.rstrip(".,;:!?\"')").isalpha()


def write_task_files(directory):
    """The four stand-in task files in `directory` (kept if present):
    `{name: path}`."""
    paths = {name: os.path.join(directory, f"{name}.jsonl") for name in SIZES}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(0)
    pool, seen = [], set()
    for words in paragraphs():
        if " ".join(words[:12]) in seen:
            continue  # the books' shared front matter
        seen.add(" ".join(words[:12]))
        pool.append(words)
        if len(pool) >= 4 * sum(SIZES.values()):
            break
    rows = {name: [] for name in SIZES}
    for i, words in enumerate(pool):
        if len(rows["lambada"]) < SIZES["lambada"]:
            n = min(rng.randint(40, 120), len(words))
            while n > 8 and not alphabetic(words[n - 1]):
                n -= 1
            if n > 8:
                text = words[:n]
                text[-1] = text[-1].rstrip(".,;:!?\"')")
                rows["lambada"].append({"text": " ".join(text)})
        for name, (query, choice, count) in {
            "piqa": (8, 20, 2),
            "arc_easy": (22, 4, 4),
            "copa": (6, 6, 2),
        }.items():
            if len(rows[name]) >= SIZES[name] or len(words) < query + choice:
                continue
            choices = [" ".join(words[query : query + choice])]
            for k in range(1, count):
                source = pool[(i + 31 * k) % len(pool)]
                start = rng.randint(0, max(0, len(source) - choice))
                choices.append(" ".join(source[start : start + choice]))
            gold = rng.randrange(count)
            choices[0], choices[gold] = choices[gold], choices[0]
            rows[name].append(
                {
                    "query": " ".join(words[:query]),
                    "choices": choices,
                    "gold": gold,
                }
            )
    for name, path in paths.items():
        if len(rows[name]) < SIZES[name]:
            raise RuntimeError(
                f"Only {len(rows[name])} {name} examples could be written."
            )
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            for row in rows[name]:
                f.write(json.dumps(row) + "\n")
        os.replace(path + ".tmp", path)
    return paths


def run_evaluation(command, timeout=None):
    """Runs `command`; `(seconds, peak RSS MB, return code, stdout,
    stderr)`. Killed with SIGKILL after `timeout` seconds (return code
    -9)."""
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=common.ROOT,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        out, err = process.communicate()
    seconds = time.perf_counter() - start
    # The process has been reaped by communicate(); its usage is in
    # RUSAGE_CHILDREN: the largest peak among the children waited for so
    # far, so a resumed part reports the larger of both runs.
    peak = common.children_peak_rss_bytes() / 2**20
    return seconds, peak, process.returncode, out, err


def main(argv=None):
    args = parse_args(argv)
    tasks = write_task_files(os.path.join(args.work_dir, "tasks"))
    lambada = args.lambada if args.lambada is not None else [tasks["lambada"]]
    choice = (
        args.multiple_choice
        if args.multiple_choice is not None
        else [tasks["piqa"], tasks["arc_easy"], tasks["copa"]]
    )
    output = os.path.join(args.work_dir, "results.jsonl")
    if os.path.exists(output):
        os.remove(output)
    command = common.keras_mhf_command(
        "evaluate",
        "--preset",
        args.preset,
        "--lambada",
        *lambada,
        "--multiple-choice",
        *choice,
        "--batch-size",
        str(args.batch_size),
        "--output",
        output,
    )
    parts = []
    if args.interrupt_after:
        seconds, peak, code, _, err = run_evaluation(
            command, args.interrupt_after
        )
        with open(output, encoding="utf-8") as f:
            recorded = sum('"index"' in line for line in f)
        if code != -signal.SIGKILL:
            raise RuntimeError(
                f"The first run ended (status {code}) before "
                f"--interrupt-after {args.interrupt_after:g} s: use a "
                f"shorter one.\n{err[-3000:]}"
            )
        parts.append(
            {
                "part": "interrupted (SIGKILL)",
                "seconds": seconds,
                "peak_rss_mb": peak,
                "examples_recorded": recorded,
            }
        )
        print(f"Killed after {seconds:.0f} s: {recorded} examples recorded.")
    seconds, peak, code, out, err = run_evaluation(command)
    if code != 0:
        raise RuntimeError(f"keras-mhf evaluate failed:\n{err[-3000:]}")
    metrics = json.loads(out[out.index("{") :])
    shapes = [line for line in err.splitlines() if "compiled scoring" in line]
    parts.append(
        {
            "part": "resumed" if parts else "whole",
            "seconds": seconds,
            "peak_rss_mb": peak,
        }
    )
    report = {
        "preset": args.preset,
        "batch_size": args.batch_size,
        "tasks": {"lambada": lambada, "multiple_choice": choice},
        "parts": parts,
        "total_seconds": sum(p["seconds"] for p in parts),
        "peak_rss_mb": max(p["peak_rss_mb"] for p in parts),
        "compiled_shapes": shapes[-1] if shapes else None,
        "metrics": metrics,
    }
    text = result_tables.evaluation_at_scale_report(report)
    print(text)
    common.write_json(args.report + ".json", report)
    with open(args.report + ".md", "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
