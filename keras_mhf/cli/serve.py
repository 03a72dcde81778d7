"""Serve a preset over HTTP with the OpenAI completions API.

    keras-mhf serve --preset runs/quickstart/mhf/preset
    keras-mhf serve --preset runs/mhf/preset --port 8001 --model-name mhf

Routes: GET /v1/models, GET /health, POST /v1/completions (`stream: true`
for server-sent events), and the tokenizer routes lm-eval's
`tokenizer_backend=remote` reads (GET /tokenizer_info, POST /tokenize,
POST /detokenize). Any OpenAI client talks to it:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    for chunk in client.completions.create(
            model="preset", prompt="The cell", max_tokens=32, stream=True):
        print(chunk.choices[0].text, end="", flush=True)

and lm-eval evaluates it with its own `local-completions` model:

    lm_eval --model local-completions --tasks lambada_openai \\
        --model_args model=preset,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=remote

Requests that arrive together (within --batch-wait-ms) with the same
sampling settings run as one batch. It binds 127.0.0.1 unless --host says
otherwise; Ctrl-C or SIGTERM stops it after the requests in flight (exit 0).
Log-probs follow the model's scoring rule (GET /v1/models says which).
"""

import os
import signal
import socket
import sys

from keras_mhf.cli.common import parser_from_doc
from keras_mhf.settings.rules import preset_directory


def build_parser(prog=None):
    parser = parser_from_doc(__doc__, prog)
    parser.add_argument(
        "--preset",
        required=True,
        type=preset_directory,
        help="preset directory (or a Hugging Face export, or a .keras file)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (0.0.0.0 serves other machines too)",
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="port (0: any free one)"
    )
    parser.add_argument(
        "--model-name",
        help="the model's id in the API (default: the preset folder's name)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="longest prompt plus completion in tokens (default: the "
        "preset's sequence_length)",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=8,
        help="most prompts generated together",
    )
    parser.add_argument(
        "--batch-wait-ms",
        type=float,
        default=20.0,
        help="how long the first request of a batch waits for others",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=8,
        help="decoding steps between streamed pieces",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 * 2**20,
        help="largest request body (larger: 413)",
    )
    parser.add_argument(
        "--log-requests",
        action="store_true",
        help="print uvicorn's line for each request",
    )
    return parser


def _model_name(preset):
    path = os.path.abspath(os.fspath(preset)).rstrip(os.sep)
    name = os.path.basename(path)
    if name.endswith(".keras"):
        name = name[: -len(".keras")]
    return name or "model"


def _bound_socket(parser, host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        parser.error(
            f"cannot listen on {host}:{port}: {error.strerror}; choose "
            "another --port (0: any free one)."
        )
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def main(argv=None, prog=None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    for name in ("max_batch_size", "chunk_size", "max_body_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1.")
    if args.batch_wait_ms < 0:
        parser.error("--batch-wait-ms must be >= 0.")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be from 0 to 65535; got {args.port}.")
    import keras
    import uvicorn

    from keras_mhf.models.preset_loading import load_causal_lm
    from keras_mhf.serving import ServedModel
    from keras_mhf.serving import completions_app

    sock = _bound_socket(parser, args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(
        f"{parser.prog}: Keras backend {keras.config.backend()}; loading "
        f"{args.preset}",
        flush=True,
    )
    try:
        lm = load_causal_lm(args.preset)
        served = ServedModel(
            lm, args.model_name or _model_name(args.preset), args.max_model_len
        )
    except (ValueError, OSError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    app = completions_app(
        lm,
        served,
        max_batch_size=args.max_batch_size,
        batch_wait=args.batch_wait_ms / 1000,
        chunk_size=args.chunk_size,
        max_body_bytes=args.max_body_bytes,
    )
    config = uvicorn.Config(
        app,
        log_level="info" if args.log_requests else "warning",
        access_log=args.log_requests,
        timeout_graceful_shutdown=None,
    )
    server = uvicorn.Server(config)
    shown = f"[{host}]" if ":" in host else host
    print(
        f"{parser.prog}: serving {served.name} ({served.kind}; log-probs: "
        f"{served.scoring_rule}) at http://{shown}:{port}/v1 once warmed up "
        "(GET /health answers then); Ctrl-C or SIGTERM stops it after the "
        "requests in flight",
        flush=True,
    )
    # uvicorn finishes the requests in flight on SIGINT/SIGTERM, then
    # raises the signal again for the handler it found: these make that a
    # clean exit (status 0) instead of a KeyboardInterrupt or a kill.
    stopped = []
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda signum, frame: stopped.append(signum))
    server.run(sockets=[sock])
    if not server.started:
        print(
            f"{parser.prog}: error: the server did not start", file=sys.stderr
        )
        return 1
    print(f"{parser.prog}: stopped", flush=True)
    return 0
