"""`keras-mhf serve`: the OpenAI completions API over a preset, tested with
the clients users have (the `openai` package, httpx, lm-eval's
`local-completions`). One server per module, in its own process on
127.0.0.1 and a free port, stopped by its process id."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
import requests

from keras_mhf import evaluation
from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerTokenizer
from tests.conftest import REPO

openai = pytest.importorskip("openai")

NAME = "tiny-mhf"
START_TIMEOUT = 240  # seconds: imports, loading, the warm-up's compiling


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def preset(tmp_path_factory, small_proto):
    keras.utils.set_random_seed(0)
    lm = MultiHashFormerCausalLM.from_tokenizer(
        MultiHashFormerTokenizer(small_proto), "tiny_h3b64", sequence_length=96
    )
    path = str(tmp_path_factory.mktemp("serve") / NAME)
    lm.save_to_preset(path)
    return path


@pytest.fixture(scope="module")
def server(preset, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server_log") / "serve.log"
    log = open(log_path, "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keras_mhf.cli.main",
            "serve",
            "--preset",
            preset,
            "--port",
            str(port),
            "--batch-wait-ms",
            "300",
            "--max-body-bytes",
            "20000",
            # Past the preset's 96: a long answer, still being written when
            # its client leaves (RoPE positions, no new weights).
            "--max-model-len",
            "4096",
        ],
        cwd=str(REPO),
        # A file, not a pipe that nobody reads while it serves.
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    for _ in range(2 * START_TIMEOUT):
        if process.poll() is not None or time.monotonic() > deadline:
            break
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(0.5)
    else:
        process.kill()
    if process.poll() is not None:
        log.close()
        pytest.fail(f"the server ended: {log_path.read_text()[-3000:]}")
    yield {"url": url, "process": process}
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=f"{server['url']}/v1",
        api_key="none",
        timeout=120,
        max_retries=0,
    )


@pytest.fixture(scope="module")
def local_lm(preset):
    from keras_mhf.models.preset_loading import load_causal_lm

    lm = load_causal_lm(preset)
    lm.compile(sampler="greedy")
    return lm


def test_openai_client_streams_generates_text(client, local_lm):
    """The `openai` client, streaming and not: greedy text is the text of
    `generate(..., strip_prompt=True)` on the same preset in this process,
    in several pieces when streamed."""
    want = local_lm.generate("The cell", max_new_tokens=12, strip_prompt=True)
    done = client.completions.create(
        model=NAME, prompt="The cell", max_tokens=12, temperature=0
    )
    assert done.choices[0].text == want
    assert done.choices[0].finish_reason in ("length", "stop")
    assert done.usage.prompt_tokens == 3  # <s> The cell
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt="The cell",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want
    assert len([t for t in texts if t]) >= 2
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    # Seeded sampling repeats itself.
    seeded = [
        client.completions.create(
            model=NAME,
            prompt="Water",
            max_tokens=8,
            temperature=0.9,
            top_p=0.9,
            seed=5,
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_models_health_and_tokenizer_routes(server, client, local_lm):
    (card,) = client.models.list().data
    assert card.id == NAME
    assert card.model_dump()["max_model_len"] == 4096
    assert "paper's rule" in card.model_dump()["scoring_rule"]
    url = server["url"]
    info = requests.get(f"{url}/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"]) == ("<s>", "</s>")
    tokenizer = local_lm.preprocessor.tokenizer
    want = [int(t) for t in keras.ops.convert_to_numpy(tokenizer("The cell"))]
    got = requests.post(
        f"{url}/tokenize",
        json={"prompt": "The cell", "add_special_tokens": False},
    ).json()["tokens"]
    assert got == want
    got = requests.post(f"{url}/tokenize", json={"prompt": "</s>"}).json()
    assert got["tokens"] == [tokenizer.start_token_id, tokenizer.end_token_id]
    text = requests.post(f"{url}/detokenize", json={"tokens": want}).json()
    assert text == {"prompt": "The cell"}


def test_echo_logprobs_are_the_evaluation_scores(client, local_lm):
    """Token-id prompts with echo and log-probs (lm-eval's requests): the
    prompt's log-probs are `evaluation.token_log_likelihoods` with `<s>`
    first, and a token that is the argmax heads its top entries."""
    tokenizer = local_lm.preprocessor.tokenizer
    prompts = ["The cell is the basic unit", "Water boils"]
    rows = [
        [int(t) for t in keras.ops.convert_to_numpy(tokenizer(p))]
        for p in prompts
    ]
    done = client.completions.create(
        model=NAME,
        prompt=rows,
        max_tokens=1,
        temperature=0,
        echo=True,
        logprobs=1,
    )
    for choice, row in zip(sorted(done.choices, key=lambda c: c.index), rows):
        ids = np.asarray([[tokenizer.start_token_id] + row], "int32")
        log_probs, is_argmax = evaluation.scoring.next_token_scores(
            local_lm, ids
        )
        got = choice.logprobs.token_logprobs
        assert len(got) == len(row) + 1
        np.testing.assert_allclose(got[: len(row)], log_probs[0], atol=1e-6)
        for value, top, argmax in zip(
            got, choice.logprobs.top_logprobs, is_argmax[0]
        ):
            assert (max(top.values()) == value) == bool(argmax)


BAD = [
    (b"{not json", 400, None),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"model": NAME, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": NAME, "prompt": "x", "n": 2}, 400, "n"),
    ({"model": NAME, "prompt": [5, 99999]}, 400, "prompt"),
    ({"model": NAME, "prompt": {"text": "x"}}, 422, "prompt"),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x" * 30000}, 413, None),
]


def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, client):
    url = f"{server['url']}/v1/completions"
    with requests.Session() as http:
        for body, status, param in BAD:
            if isinstance(body, bytes):
                response = http.post(
                    url,
                    data=body,
                    timeout=60,
                    headers={"content-type": "application/json"},
                )
            else:
                response = http.post(url, json=body, timeout=60)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert error["message"] and error["type"]
            assert error["param"] == param
        missing = http.get(f"{server['url']}/v1/nothing", timeout=60)
        assert missing.status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    # Still serving; a request with more prompts than a batch (8) runs in
    # several, each prompt's text as when it is alone.
    alone = client.completions.create(
        model=NAME, prompt="The", max_tokens=2, temperature=0
    )
    done = client.completions.create(
        model=NAME, prompt=["The"] * 9, max_tokens=2, temperature=0
    )
    texts = [c.text for c in sorted(done.choices, key=lambda c: c.index)]
    assert texts == [alone.choices[0].text] * 9


def test_concurrent_requests_share_a_batch(server, client):
    """8 streaming clients at once (the server waits 300 ms for a batch
    here) run as one generation; a client that leaves mid-stream frees its
    place and the others finish."""
    url = server["url"]
    before = requests.get(f"{url}/health").json()
    texts = [None] * 8
    barrier = threading.Barrier(8)

    def ask(i):
        barrier.wait(timeout=30)
        stream = client.completions.create(
            model=NAME,
            prompt=f"Water {i}",
            max_tokens=6,
            temperature=0,
            stream=True,
        )
        texts[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    after = requests.get(f"{url}/health").json()
    assert all(t is not None for t in texts)
    assert after["batched_rows"] - before["batched_rows"] == 8
    assert after["batches"] - before["batches"] == 1
    # A client that leaves after its first piece.
    with requests.post(
        f"{url}/v1/completions",
        timeout=60,
        stream=True,
        json={
            "model": NAME,
            "prompt": "The",
            "max_tokens": 4000,
            "temperature": 0,
            "stream": True,
        },
    ) as response:
        next(line for line in response.iter_lines() if line)
    for _ in range(100):
        if requests.get(f"{url}/health").json()["cancelled_rows"] >= 1:
            break
        time.sleep(0.1)
    assert requests.get(f"{url}/health").json()["cancelled_rows"] >= 1
    done = client.completions.create(
        model=NAME, prompt="The", max_tokens=2, temperature=0
    )
    assert done.choices[0].text is not None


def test_lm_eval_local_completions_gives_evaluates_numbers(
    server, preset, tmp_path
):
    """lm-eval's stock command line, `local-completions` with the remote
    tokenizer, on LAMBADA and PIQA rows from local files: the accuracies
    and perplexity of `keras-mhf evaluate --task` on the same rows."""
    from tests.evaluation.harness_rows import write_lm_eval_tasks

    definitions, files = write_lm_eval_tasks(str(tmp_path))
    names = ["lambada", "piqa"]
    ours = evaluation.evaluate_preset(
        preset,
        tasks=[(n, files[n]) for n in names],
        output=str(tmp_path / "ours.jsonl"),
    )
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    out = tmp_path / "lm_eval"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            f"model={NAME},base_url={server['url']}/v1/completions,"
            "tokenizer_backend=remote",
            "--tasks",
            ",".join(f"local_{n}" for n in names),
            "--include_path",
            definitions,
            "--output_path",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (found,) = [
        os.path.join(root, f)
        for root, _, names_ in os.walk(out)
        for f in names_
        if f.startswith("results")
    ]
    results = json.load(open(found))["results"]
    for name in names:
        metrics = ours[f"{name}:{files[name]}"]
        for metric in ("acc", "acc_norm", "perplexity"):
            if metric in metrics:
                np.testing.assert_allclose(
                    results[f"local_{name}"][f"{metric},none"],
                    metrics[metric],
                    rtol=1e-5,
                    err_msg=f"{name} {metric}",
                )


def test_sigterm_finishes_the_request_in_flight_and_exits_0(server):
    """The last test: SIGTERM while a stream is being written; the stream
    ends with its finish reason and [DONE], then the server exits 0."""
    process = server["process"]
    lines = []

    def read():
        with requests.post(
            f"{server['url']}/v1/completions",
            timeout=120,
            stream=True,
            json={
                "model": NAME,
                "prompt": "The",
                "max_tokens": 60,
                "temperature": 0,
                "stream": True,
            },
        ) as response:
            for line in response.iter_lines(decode_unicode=True):
                lines.append(line)
                if len(lines) == 1:
                    os.kill(process.pid, signal.SIGTERM)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout=120)
    assert process.wait(timeout=60) == 0
    events = [line[len("data: ") :] for line in lines if line]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] in ("length", "stop")
