"""Serving: `keras-mhf serve`'s streamed completions, one client alone
against 8 clients at once (static batching), for MultiHashFormer and the
Standard baseline (KerasHub Qwen3) on the same trunk and tokenizer,
measured in the same run.

Each model (random weights, float32, a SentencePiece tokenizer trained
here) is saved as a preset (`lm.save_to_preset`) in a temporary folder and
served by its own `keras-mhf serve --preset DIR --port 0` subprocess on
127.0.0.1 (each started as soon as its preset is saved; each stopped by
its pid with SIGTERM at the end, and its exit status reported). `--quick`
serves the MHF preset alone (a tiny one, 8 new tokens, one round). Once `GET /health` answers, the
`openai` package's client streams greedy completions
(`completions.create(model=NAME, prompt=..., max_tokens=N, temperature=0,
stream=True, stream_options={"include_usage": True})`; NAME is the preset
folder's name; the prompts hold no stop string):

- single: one client alone, `PROMPTS[0]`: tokens/s = completion tokens (the
  stream's final usage chunk) / wall time of the whole stream, and the
  time to its first chunk;
- concurrent: `--clients` threads (each its own client and prompt,
  released together by a barrier): tokens/s = all their completion tokens /
  the wall time from the first request sent to the last stream ended, and
  the mean time to first chunk. `/health`'s counters (`batches`,
  `batched_rows`) are read before and after, so each round shows how many
  batches the requests ran in.

After one warm-up request of each shape (batch 1 and batch 8 compile
separately on JAX), `--repeats` rounds time, for each model in turn, one
single and one concurrent run; the numbers are the best round of each. The
batching ratio is concurrent tokens/s over single (the target is >= 3x);
MHF / Standard ratios compare the two servers. An untrained model may
emit `</s>` early, which the API cannot forbid: the completion tokens are
reported as counted, and rows with fewer than `max_tokens` are flagged.

    python -m benchmarks.serving       # KERAS_BACKEND's (default jax);
        # writes benchmarks/results/serving_<backend>.json and .md
    KERAS_BACKEND=torch python -m benchmarks.serving
    python -m benchmarks.serving --quick --output /tmp/s.json   # seconds
"""

import argparse
import contextlib
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

from benchmarks import common
from benchmarks import result_tables

# The target of the server's static batching: 8 clients at once make at
# least 3x the tokens/s of one alone.
TARGET = 3.0
# One prompt per client (the single client sends the first).
PROMPTS = [
    "The cell is the basic unit of life",
    "Energy is conserved in a closed system",
    "Water boils at one hundred degrees",
    "A market price rises when demand grows",
    "The mitochondria release energy that",
    "Light travels faster than sound, which",
    "Plants turn sunlight, water and carbon",
    "An atom has a nucleus of protons and",
]
MODELS = ("mhf", "standard")
QUICK = dict(
    architecture="tiny_h3b64",
    vocabulary_size=120,
    max_tokens=8,
    repeats=1,
    models=["mhf"],  # one server: the smoke test stays within seconds
)
# Bounds of the wait loops.
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
POLL_S = 0.1


# --- models -------------------------------------------------------------------


def save_presets(args, root, models=MODELS):
    """Builds a random MHF of `args.architecture` and the Standard baseline
    on its trunk (one tokenizer, seed 0 each) and saves them as presets
    `root/mhf` and `root/standard`, yielding `(name, directory,
    parameters)` as each is saved (so that its server can start while the
    next is built)."""
    import keras

    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import MultiHashFormerTokenizer
    from keras_mhf.models import standard_causal_lm
    from keras_mhf.utils.keras_utils import count_trainable_parameters

    tokenizer = MultiHashFormerTokenizer(
        common.benchmark_sentencepiece(args.vocabulary_size)
    )
    length = 2 * (args.max_tokens + 64)
    builders = {
        "mhf": lambda: MultiHashFormerCausalLM.from_tokenizer(
            tokenizer, args.architecture, sequence_length=length
        ),
        "standard": lambda: standard_causal_lm(
            tokenizer, args.architecture.split("_")[0], sequence_length=length
        ),
    }
    for name in models:
        keras.utils.set_random_seed(0)
        lm = builders[name]()
        directory = os.path.join(root, name)
        lm.save_to_preset(directory)
        yield name, directory, count_trainable_parameters(lm)
        del lm


# --- the server ---------------------------------------------------------------

SERVING_LINE = re.compile(r"serving (\S+) .* at http://127\.0\.0\.1:(\d+)/v1")


class Server:
    """`keras-mhf serve --preset DIR --port 0` in a subprocess: `start()`
    launches it, `wait_ready()` waits (bounded) for its serving line (the
    port it bound) and then for `GET /health`, `stop()` sends SIGTERM to its
    pid and waits (bounded; a kill after that) for its exit status."""

    def __init__(self, preset, args, env=None):
        self.preset = preset
        self.args = args
        self.env = env
        self.process = None
        self.lines = queue.Queue()
        self.output = []
        self.name = self.port = None
        self.exit_status = None
        self.startup_s = None

    def start(self):
        a = self.args
        command = common.keras_mhf_command(
            "serve",
            "--preset", self.preset,
            "--host", "127.0.0.1",
            "--port", 0,
            "--max-batch-size", a.max_batch_size,
            "--batch-wait-ms", a.batch_wait_ms,
            "--chunk-size", a.chunk_size,
        )  # fmt: skip
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            command,
            cwd=common.ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self):
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def _fail(self, why):
        tail = "".join(self.output[-40:])
        raise RuntimeError(f"keras-mhf serve {self.preset}: {why}\n{tail}")

    def wait_ready(self, timeout=START_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while self.port is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(f"no serving line within {timeout:.0f} s")
            try:
                line = self.lines.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if line is None:
                self._fail(f"exited with {self.process.wait(timeout=10)}")
            found = SERVING_LINE.search(line)
            if found:
                self.name, self.port = found.group(1), int(found.group(2))
        for _ in range(int(timeout / POLL_S) + 1):
            if self.process.poll() is not None:
                self._fail(f"exited with {self.process.returncode}")
            if time.monotonic() > deadline:
                break
            try:
                health = self.health(timeout=5)
            except (OSError, ValueError):
                time.sleep(POLL_S)
                continue
            self.startup_s = time.perf_counter() - self.started
            return health
        self._fail(f"/health did not answer within {timeout:.0f} s")

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}"

    def health(self, timeout=10):
        """`GET /health`'s JSON (an error until the server is warm)."""
        with urllib.request.urlopen(
            self.base_url + "/health", timeout=timeout
        ) as response:
            return json.loads(response.read())

    def stop(self, timeout=STOP_TIMEOUT_S):
        """SIGTERM to the server's pid, then its exit status (killed when
        it has not exited within `timeout`: the status is then negative)."""
        if self.process is None or self.process.poll() is not None:
            self.exit_status = (
                None if self.process is None else (self.process.returncode)
            )
            return self.exit_status
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.exit_status = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.exit_status = self.process.wait(timeout=timeout)
        return self.exit_status


@contextlib.contextmanager
def servers(presets, args):
    """The started and warm `Server`s of `presets` (an iterable of `(name,
    directory, parameters)`; each server starts as soon as its preset is
    there), stopped at the end whatever happens: `{name: Server}`, each
    with its `parameters`."""
    env = dict(os.environ)
    if args.torch_threads:
        env["OMP_NUM_THREADS"] = str(args.torch_threads)
    running = {}
    try:
        for name, directory, parameters in presets:
            running[name] = Server(directory, args, env).start()
            running[name].parameters = parameters
        for server in running.values():
            server.wait_ready()
        yield running
    finally:
        for server in running.values():
            server.stop()


# --- clients ------------------------------------------------------------------


def client(server):
    from openai import OpenAI

    return OpenAI(
        base_url=server.base_url + "/v1",
        api_key="none",
        timeout=120.0,
        max_retries=0,
    )


def stream_once(openai_client, name, prompt, max_tokens):
    """One greedy streamed completion: `{start, end, first (perf_counter
    times), tokens (the usage chunk's completion tokens), text, chunks,
    finish_reason}`."""
    start = time.perf_counter()
    first, texts, chunks, tokens, reason = None, [], 0, None, None
    stream = openai_client.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices:
            if first is None:
                first = time.perf_counter()
            chunks += 1
            texts.append(chunk.choices[0].text or "")
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return dict(
        start=start,
        end=end,
        first=first,
        tokens=tokens,
        text="".join(texts),
        chunks=chunks,
        finish_reason=reason,
    )


def single_run(openai_client, name, max_tokens):
    got = stream_once(openai_client, name, PROMPTS[0], max_tokens)
    seconds = got["end"] - got["start"]
    return dict(
        seconds=seconds,
        first_chunk_s=got["first"] - got["start"],
        tokens=got["tokens"],
        tokens_per_s=got["tokens"] / seconds,
        chunks=got["chunks"],
        text=got["text"],
    )


def concurrent_run(server, clients, name, max_tokens):
    """`len(clients)` streams at once (threads released by one barrier),
    and `/health`'s counters' growth over them."""
    n = len(clients)
    barrier = threading.Barrier(n)
    results, errors = [None] * n, []

    def worker(i):
        try:
            barrier.wait(timeout=60)
            results[i] = stream_once(
                clients[i], name, PROMPTS[i % len(PROMPTS)], max_tokens
            )
        except Exception as error:  # reported after the join
            errors.append(error)

    before = server.health()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"concurrent clients failed: {errors!r}")
    after = server.health()
    start = min(r["start"] for r in results)
    seconds = max(r["end"] for r in results) - start
    tokens = sum(r["tokens"] for r in results)
    firsts = [r["first"] - r["start"] for r in results]
    return dict(
        seconds=seconds,
        tokens=tokens,
        tokens_per_s=tokens / seconds,
        first_chunk_s=statistics.mean(firsts),
        max_first_chunk_s=max(firsts),
        min_tokens=min(r["tokens"] for r in results),
        batches=after["batches"] - before["batches"],
        batched_rows=after["batched_rows"] - before["batched_rows"],
    )


# --- the run ----------------------------------------------------------------


def _best(rounds):
    return max(rounds, key=lambda r: r["tokens_per_s"])


def measure(running, args):
    """The table rows (one per model) from `running` servers."""
    clients = {
        name: [client(server) for _ in range(args.clients)]
        for name, server in running.items()
    }
    n = args.max_tokens
    for name, server in running.items():  # compile both shapes
        single_run(clients[name][0], server.name, n)
        concurrent_run(server, clients[name], server.name, n)
    singles = {name: [] for name in running}
    batched = {name: [] for name in running}
    for _ in range(args.repeats):
        for name, server in running.items():
            singles[name].append(single_run(clients[name][0], server.name, n))
            batched[name].append(
                concurrent_run(server, clients[name], server.name, n)
            )
            print(name, singles[name][-1], batched[name][-1], flush=True)
    rows = []
    for name, server in running.items():
        one, many = _best(singles[name]), _best(batched[name])
        rows.append(
            dict(
                model=name,
                served_name=server.name,
                single_tokens_per_s=one["tokens_per_s"],
                single_first_chunk_s=one["first_chunk_s"],
                single_s=one["seconds"],
                single_tokens=one["tokens"],
                single_chunks=one["chunks"],
                concurrent_tokens_per_s=many["tokens_per_s"],
                concurrent_first_chunk_s=many["first_chunk_s"],
                concurrent_max_first_chunk_s=many["max_first_chunk_s"],
                concurrent_s=many["seconds"],
                concurrent_tokens=many["tokens"],
                concurrent_min_tokens=many["min_tokens"],
                batching_ratio=many["tokens_per_s"] / one["tokens_per_s"],
                batches=many["batches"],
                batched_rows=many["batched_rows"],
                rounds_batches=[r["batches"] for r in batched[name]],
                rounds_batched_rows=[r["batched_rows"] for r in batched[name]],
                rounds_single_tokens_per_s=[
                    r["tokens_per_s"] for r in singles[name]
                ],
                rounds_concurrent_tokens_per_s=[
                    r["tokens_per_s"] for r in batched[name]
                ],
                full_length=one["tokens"] == n and many["min_tokens"] == n,
                startup_s=server.startup_s,
            )
        )
    return rows


def mhf_over_standard(rows):
    """MHF's numbers over Standard's (tokens/s: > 1 is MHF faster; times:
    < 1 is MHF sooner)."""
    found = {r["model"]: r for r in rows}
    if not {"mhf", "standard"} <= set(found):
        return {}
    mhf, standard = found["mhf"], found["standard"]
    return {
        key: mhf[key] / standard[key]
        for key in (
            "single_tokens_per_s",
            "concurrent_tokens_per_s",
            "single_first_chunk_s",
            "concurrent_first_chunk_s",
            "batching_ratio",
        )
        if mhf.get(key) and standard.get(key)
    }


def report(data):
    """The Markdown report of a run."""
    lines = [
        f"# Serving: one client and {data['settings']['clients']} at once "
        f"({data['label']})",
        "",
        result_tables.serving_caption(data["settings"], data["backend"]),
        "",
        *result_tables.serving_table(data["results"], data["target"]),
        "",
        result_tables.serving_summary(data),
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    p = common.argument_parser(
        "serving",
        __doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--backend-label",
        default=None,
        help="name of the run in the report and the output file "
        "(default: KERAS_BACKEND's backend)",
    )
    p.add_argument("--architecture", default="small_h4b1024")
    p.add_argument(
        "--vocabulary-size",
        type=int,
        default=4000,
        help="SentencePiece pieces (above 120: trained on the OpenStax "
        "sample of tests/testdata)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="rounds (best of)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--batch-wait-ms", type=float, default=20.0)
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="PyTorch servers' intra-op threads (OMP_NUM_THREADS; 0: "
        "PyTorch's default)",
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=list(MODELS),
        choices=MODELS,
        help="the models served",
    )
    p.add_argument(
        "--output",
        default=None,
        help="JSON result (a .md beside it); default "
        "benchmarks/results/serving_<label>.json",
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
    os.environ.setdefault("KERAS_BACKEND", "jax")  # keras-mhf's default
    import keras

    backend = keras.config.backend()
    label = args.backend_label or backend
    if backend != "torch":
        args.torch_threads = None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        presets = save_presets(args, root, args.models)
        with servers(presets, args) as running:
            ready = time.perf_counter()
            rows = measure(running, args)
        for row in rows:
            server = running[row["model"]]
            row.update(
                parameters=server.parameters, exit_status=server.exit_status
            )
    timings = dict(
        until_ready_s=ready - start, after_ready_s=time.perf_counter() - ready
    )
    settings = {k: v for k, v in vars(args).items() if k != "output"}
    settings.update(prompts=PROMPTS, sampler="greedy (temperature 0)")
    data = {
        "backend": backend,
        "label": label,
        "settings": settings,
        "target": TARGET,
        "results": rows,
        "mhf_over_standard": mhf_over_standard(rows),
        "seconds": time.perf_counter() - start,
        **timings,
    }
    output = args.output or os.path.join(
        common.RESULTS, f"serving_{label}.json"
    )
    common.write_json(output, data)
    text = report(data)
    with open(os.path.splitext(output)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
