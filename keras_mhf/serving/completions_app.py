"""The OpenAI completions API over a causal LM, as a FastAPI application.

Routes: `GET /health`, `GET /v1/models`, `POST /v1/completions` (streamed
with server-sent events when `stream` is true), and the tokenizer routes
that vLLM serves and lm-eval's `tokenizer_backend=remote` reads:
`GET /tokenizer_info`, `POST /tokenize`, `POST /detokenize`. Every error is
an OpenAI error body with its status (400 bad value, 404 unknown model or
route, 413 body too large, 422 malformed field, 500 a failed generation),
and the server goes on serving.
"""

import asyncio
import contextlib
import json
import time
import uuid

from fastapi import FastAPI
from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException

from keras_mhf.serving.api_error import ApiError
from keras_mhf.serving.completion_batcher import CompletionBatcher
from keras_mhf.serving.completion_batcher import CompletionJob
from keras_mhf.serving.completion_request import CompletionRequest
from keras_mhf.serving.prompt_logprobs import openai_logprobs

MAX_BODY_BYTES = 8 * 2**20


async def _read_json(request, limit):
    """The request's JSON body, refused past `limit` bytes (413) or when
    it is not JSON (400)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(
            413,
            f"The request body is {length} bytes; at most {limit}.",
            code="request_too_large",
        )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(
                413,
                f"The request body is over {limit} bytes.",
                code="request_too_large",
            )
    try:
        return json.loads(bytes(body))
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, f"The request body is not valid JSON: {error}.")


def _logprobs_object(served, request, i, data):
    """A non-streamed choice's `logprobs` (prompt's with echo, then the
    completion's)."""
    prompt, completion = data["logprobs"]
    ids, values, tops = [], [], []
    if prompt is not None:
        shown = (
            request.prompts[i][1:]
            if request.added_start[i]
            else (request.prompts[i])
        )
        ids += shown
        values += prompt[0]
        tops += prompt[1]
    if completion is not None:
        ids += data["ids"]
        values += completion[0]
        tops += completion[1]
    offset = 0 if request.echo else len(data["prompt_text"])
    result = openai_logprobs(
        served, ids, values, tops if request.logprobs else None, offset
    )
    return result


def _usage(request, completion_tokens):
    prompt_tokens = sum(len(p) for p in request.prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completions_app(
    causal_lm,
    served,
    max_batch_size=8,
    batch_wait=0.02,
    chunk_size=8,
    max_body_bytes=MAX_BODY_BYTES,
    warm_up=True,
):
    """The FastAPI application serving `causal_lm` (see the module's
    docstring); uvicorn runs it (`keras-mhf serve`).

    Args:
        causal_lm: the causal LM, with its preprocessor.
        served: its `ServedModel`.
        max_batch_size, batch_wait, chunk_size: the `CompletionBatcher`'s.
        max_body_bytes: the largest request body.
        warm_up: compile the greedy path (one token) before serving.

    Example:

    ```python
    import uvicorn
    app = completions_app(lm, ServedModel(lm, "mhf"))
    uvicorn.run(app, host="127.0.0.1", port=8000)
    ```
    """
    batcher = CompletionBatcher(
        causal_lm, served, max_batch_size, batch_wait, chunk_size
    )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.start()
        if warm_up:
            await _complete(
                batcher,
                served,
                {"prompt": "", "max_tokens": 1, "temperature": 0},
            )
        yield
        batcher.stop(timeout=60)

    app = FastAPI(
        title=f"keras-mhf serve: {served.name}",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.batcher = batcher

    _add_error_handlers(app)
    _add_model_routes(app, served, batcher)
    _add_tokenizer_routes(app, served, max_body_bytes)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _read_json(request, max_body_bytes)
        if isinstance(body, dict) and body.get("stream") is True:
            parsed = CompletionRequest.from_body(body, served)
            return StreamingResponse(
                _stream(batcher, served, parsed), media_type="text/event-stream"
            )
        return await _complete(batcher, served, body)

    return app


def _add_error_handlers(app):
    """OpenAI error bodies for refused requests, unknown routes and
    unexpected errors."""

    @app.exception_handler(ApiError)
    async def api_error(request, error):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, error):
        return JSONResponse(
            ApiError(error.status_code, str(error.detail)).body(),
            status_code=error.status_code,
        )

    @app.exception_handler(Exception)
    async def unexpected(request, error):
        problem = ApiError(500, f"{type(error).__name__}: {error}")
        return JSONResponse(problem.body(), status_code=500)


def _add_model_routes(app, served, batcher):
    """`GET /health`, `GET /v1/models` and `GET /v1/models/{name}`."""

    @app.get("/health")
    def health():
        return {
            "status": "ok",
            "model": served.name,
            "batches": batcher.batches,
            "batched_rows": batcher.batched_rows,
            "cancelled_rows": batcher.cancelled_rows,
        }

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [served.card()]}

    @app.get("/v1/models/{name}")
    def model(name: str):
        if name != served.name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist.",
                code="model_not_found",
            )
        return served.card()


def _add_tokenizer_routes(app, served, max_body_bytes):
    """vLLM's tokenizer routes, which lm-eval's remote tokenizer reads."""

    @app.get("/tokenizer_info")
    def tokenizer_info():
        return served.tokenizer.info(served.max_length)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _read_json(request, max_body_bytes)
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, str):
            raise ApiError(422, "prompt must be a string.", param="prompt")
        special = body.get("add_special_tokens", True)
        tokens = served.tokenizer.encode(prompt, bool(special))
        return {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": served.max_length,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _read_json(request, max_body_bytes)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        size = served.tokenizer.vocabulary_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise ApiError(
                422, "tokens must be a list of token ids.", param="tokens"
            )
        bad = [t for t in tokens if not 0 <= t < size]
        if bad:
            raise ApiError(
                400,
                f"token id {bad[0]} is out of range (0 to {size - 1}).",
                param="tokens",
            )
        return {"prompt": served.tokenizer.decode(tokens)}


def _submit(batcher, request):
    loop = asyncio.get_running_loop()
    events = asyncio.Queue()

    def on_event(event):
        loop.call_soon_threadsafe(events.put_nowait, event)

    job = batcher.submit(CompletionJob(request, on_event))
    return job, events


def _header(served):
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
    }


async def _complete(batcher, served, body):
    request = CompletionRequest.from_body(body, served)
    job, events = _submit(batcher, request)
    choices = [None] * len(request.prompts)
    completion_tokens = 0
    try:
        while True:
            event = await events.get()
            if event.kind == "error":
                raise event.data
            if event.kind == "end":
                break
            if event.kind != "finish":
                continue
            data, i = event.data, event.row
            completion_tokens += len(data["ids"])
            text = data["text"]
            if request.echo:
                text = data["prompt_text"] + text
            logprobs = None
            if request.logprobs is not None:
                logprobs = _logprobs_object(served, request, i, data)
            choices[i] = {
                "index": i,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": data["reason"],
            }
    finally:
        job.cancel()  # a client gone frees its rows; a no-op after "end"
    return {
        **_header(served),
        "choices": choices,
        "usage": _usage(request, completion_tokens),
    }


async def _stream(batcher, served, request):
    job, events = _submit(batcher, request)
    header = _header(served)
    completion_tokens = 0
    offsets = {}

    def chunk(choices, **extra):
        return (
            f"data: {json.dumps({**header, 'choices': choices, **extra})}\n\n"
        )

    try:
        while True:
            event = await events.get()
            if event.kind == "error":
                yield f"data: {json.dumps(event.data.body())}\n\n"
                break
            if event.kind == "end":
                if request.include_usage:
                    yield chunk([], usage=_usage(request, completion_tokens))
                break
            data, i = event.data, event.row
            if event.kind == "finish":
                completion_tokens += len(data["ids"])
                yield chunk(
                    [
                        {
                            "index": i,
                            "text": "",
                            "logprobs": None,
                            "finish_reason": data["reason"],
                        }
                    ]
                )
                continue
            logprobs = None
            if data["logprobs"] is not None:
                values, tops = data["logprobs"]
                at = offsets.get(i, 0)
                logprobs = openai_logprobs(
                    served,
                    data["ids"],
                    values,
                    tops if request.logprobs else None,
                    at,
                    first=i not in offsets or data.get("echo", False),
                )
            offsets[i] = offsets.get(i, 0) + len(data["text"])
            yield chunk(
                [
                    {
                        "index": i,
                        "text": data["text"],
                        "logprobs": logprobs,
                        "finish_reason": None,
                    }
                ]
            )
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()
