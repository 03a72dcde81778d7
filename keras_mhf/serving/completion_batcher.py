"""Static batching of completion requests onto one model."""

import collections
import queue
import threading
import time
import traceback

import numpy as np

from keras_mhf.models.generation_stream import DEFAULT_CHUNK_SIZE
from keras_mhf.models.generation_stream import TextPieces
from keras_mhf.models.generation_stream import TokenStream
from keras_mhf.models.generation_stream import make_sampler
from keras_mhf.serving.api_error import ApiError
from keras_mhf.serving.prompt_logprobs import token_logprobs

# Widths (prompt plus new tokens) are rounded up to a multiple of this, and
# batches to a power of two rows, so a server compiles a few shapes.
WIDTH_MULTIPLE = 32

_STOP = object()

Event = collections.namedtuple("Event", ["kind", "row", "data"])
Event.__doc__ = """What a job hears from the batcher, in order:
`("text", row, {"text", "ids", "logprobs"})` for each new piece of a row,
`("finish", row, {"reason", "ids", "text", "prompt_text", "logprobs"})`
once per row (the whole text, and for a request that is not streamed
`logprobs` = `(prompt's or None, completion's or None)`), then
`("end", None, None)`; or `("error", None, ApiError)` and nothing more."""


class CompletionJob:
    """One request's rows on their way through the batcher: `on_event` is
    called (from the batcher's thread) with each `Event`; `cancel()` ends
    its rows at the next chunk (a client gone)."""

    def __init__(self, request, on_event):
        self.request = request
        self.on_event = on_event
        self.cancelled = threading.Event()

    def cancel(self):
        self.cancelled.set()

    @property
    def batch_key(self):
        """Jobs with equal keys can share a batch: the same sampler
        settings, and no seed when sampling (a seeded request runs alone,
        so its seed alone decides its tokens)."""
        r = self.request
        if r.sampler_name == "greedy":
            return ("greedy",)
        if r.seed is not None:
            return ("seeded", id(self))
        return (r.sampler_name, r.temperature, r.top_p, r.top_k)


class CompletionBatcher:
    """Runs completion jobs on one causal LM in a thread of its own (the only
    thread that touches the model), batching jobs that arrive within
    `batch_wait` seconds of each other and share sampler settings, up to
    `max_batch_size` rows, into one streamed generation
    (`keras_mhf.models.generation_stream.TokenStream`).

    Args:
        causal_lm: the served causal LM (with its preprocessor).
        served: the served model's facts (`tokenizer`, `max_length`).
        max_batch_size: most rows in a generation (a request with more
            prompts runs alone, in several).
        batch_wait: seconds the first job of a batch waits for others.
        chunk_size: decoding steps between the host's reads.

    Example:

    ```python
    batcher = CompletionBatcher(lm, served)
    batcher.start()
    batcher.submit(CompletionJob(request, print))
    batcher.stop()
    ```
    """

    def __init__(
        self,
        causal_lm,
        served,
        max_batch_size=8,
        batch_wait=0.02,
        chunk_size=DEFAULT_CHUNK_SIZE,
    ):
        self.causal_lm = causal_lm
        self.served = served
        self.max_batch_size = int(max_batch_size)
        self.batch_wait = float(batch_wait)
        self.chunk_size = int(chunk_size)
        self.queue = queue.Queue()
        self.deferred = collections.deque()
        self.samplers = {}  # unseeded sampling keeps one random stream
        self.batches = 0
        self.batched_rows = 0
        self.cancelled_rows = 0  # rows whose client left
        self.thread = None

    def start(self):
        self.thread = threading.Thread(
            target=self._loop, name="keras-mhf-batcher", daemon=True
        )
        self.thread.start()

    def stop(self, timeout=None):
        """Ends the thread after the jobs already submitted."""
        self.queue.put(_STOP)
        if self.thread is not None:
            self.thread.join(timeout)

    def submit(self, job):
        self.queue.put(job)
        return job

    # --- The batcher's thread -----------------------------------------------

    def _take(self, block=True, timeout=None):
        if self.deferred:
            return self.deferred.popleft()
        return self.queue.get(block=block, timeout=timeout)

    def _loop(self):
        stopping = False
        while not stopping or self.deferred:
            job = self._take()
            if job is _STOP:
                stopping = True
                continue
            batch, rows = [job], len(job.request.prompts)
            deadline = time.monotonic() + self.batch_wait
            kept = collections.deque()
            while rows < self.max_batch_size:
                remaining = deadline - time.monotonic()
                try:
                    other = self._take(timeout=max(remaining, 0.0))
                except queue.Empty:
                    break
                if other is _STOP:
                    stopping = True
                    break
                size = len(other.request.prompts)
                if (
                    other.batch_key == job.batch_key
                    and rows + size <= self.max_batch_size
                ):
                    batch.append(other)
                    rows += size
                else:
                    kept.append(other)
                if remaining <= 0:
                    break
            self.deferred.extendleft(reversed(kept))
            for j in batch:
                if j.cancelled.is_set():
                    self.cancelled_rows += len(j.request.prompts)
            batch = [j for j in batch if not j.cancelled.is_set()]
            if batch:
                self._run_reporting_errors(batch)

    def _run_reporting_errors(self, batch):
        try:
            self._run(batch)
        except Exception as error:  # the server keeps serving
            traceback.print_exc()
            problem = ApiError(
                500, f"Generation failed: {type(error).__name__}: {error}"
            )
            for job in batch:
                job.on_event(Event("error", None, problem))

    def _sampler(self, job):
        r = job.request
        name = r.sampler_name
        if name == "greedy" or r.seed is not None:
            return make_sampler(name, r.temperature, r.top_k, r.top_p, r.seed)
        key = job.batch_key
        if key not in self.samplers:
            self.samplers[key] = make_sampler(
                name, r.temperature, r.top_k, r.top_p
            )
        return self.samplers[key]

    def _prompt(self, rows):
        """Packed `[b, width]` ids and mask, rows rounded up to a power of
        two (extra rows: `<s>` with no new token)."""
        real = len(rows)
        count = 1 << (real - 1).bit_length()
        start = self.served.tokenizer.start_token_id
        ids_list = [r[0] for r in rows] + [[start]] * (count - real)
        limits = [r[1] for r in rows] + [0] * (count - real)
        needed = max(len(ids) + limit for ids, limit in zip(ids_list, limits))
        width = -(-needed // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
        token_ids = np.zeros((count, width), "int32")
        mask = np.zeros((count, width), bool)
        for i, ids in enumerate(ids_list):
            token_ids[i, : len(ids)] = ids
            mask[i, : len(ids)] = True
        lengths = [len(ids) for ids in ids_list]
        return {"token_ids": token_ids, "padding_mask": mask}, lengths, limits

    def _run(self, batch):
        rows = []  # (prompt ids, limit, job, index in the job)
        for job in batch:
            for i, ids in enumerate(job.request.prompts):
                rows.append((ids, job.request.max_tokens, job, i))
        for job in batch:
            if job.request.stream and job.request.echo:
                for i, ids in enumerate(job.request.prompts):
                    self._echo(job, i, ids)
        # A request with more prompts than a batch holds runs in several.
        sampler = self._sampler(batch[0])
        for start in range(0, len(rows), self.max_batch_size):
            self._generate(rows[start : start + self.max_batch_size], sampler)
        for job in batch:
            if not job.cancelled.is_set():
                job.on_event(Event("end", None, None))

    def _generate(self, rows, sampler):
        """One streamed generation of `rows`, reporting each row's pieces
        and its finish to its job."""
        self.batches += 1
        self.batched_rows += len(rows)
        prompt, lengths, limits = self._prompt(rows)
        stream = TokenStream(
            self.causal_lm,
            prompt,
            lengths,
            limits,
            [self.served.tokenizer.end_token_id],
            sampler=sampler,
            chunk_size=self.chunk_size,
        )
        preprocessor = self.causal_lm.preprocessor
        pieces = [TextPieces(preprocessor, r[2].request.stop) for r in rows]
        generated = [[] for _ in rows]
        texts = ["" for _ in rows]
        for new_ids in stream:
            for r, (ids, _, job, i) in enumerate(rows):
                if job.cancelled.is_set():
                    if stream.finish_reasons[r] is None:
                        self.cancelled_rows += 1
                    stream.end_row(r, "cancelled")
                    continue
                new = [int(t) for t in new_ids[r]]
                if not new:
                    continue
                start = len(ids) + len(generated[r])
                generated[r] += new
                text = pieces[r].push(new)
                texts[r] += text
                if pieces[r].stopped:
                    stream.end_row(r, "stop")
                if job.request.stream:
                    self._send_text(job, i, ids, generated[r], start, text)
            if all(stream.finish_reasons[r] for r in range(len(rows))):
                break
        for r, (ids, _, job, i) in enumerate(rows):
            if job.cancelled.is_set():
                continue
            text = pieces[r].finish()
            texts[r] += text
            reason = "stop" if pieces[r].stopped else stream.finish_reasons[r]
            if job.request.stream and text:
                self._send_text(job, i, ids, generated[r], None, text)
            self._finish(job, i, ids, generated[r], reason, texts[r])

    def _logprobs(self, job, ids, start):
        """`(values, tops)` of `ids[start:]`, or `None` when the request
        wants no log-probs."""
        top = job.request.logprobs
        if top is None or start >= len(ids):
            return None
        ((values, tops),) = token_logprobs(self.causal_lm, [ids], [start], top)
        return values, (tops if top else [None] * len(values))

    def _echo(self, job, i, ids):
        """A streamed echo request's first event: the prompt."""
        added = job.request.added_start[i]
        logprobs = self._prompt_logprobs(job, i, ids)
        logprobs = None if logprobs is None else logprobs[0]
        shown = ids[1:] if added else ids
        job.on_event(
            Event(
                "text",
                i,
                {
                    "text": self._prompt_text(job, i),
                    "ids": shown,
                    "logprobs": logprobs,
                    "echo": True,
                },
            )
        )

    def _prompt_text(self, job, i):
        text = job.request.texts[i]
        if text is not None:
            return text
        ids = job.request.prompts[i]
        return self.served.tokenizer.decode(
            ids[1:] if job.request.added_start[i] else ids
        )

    def _prompt_logprobs(self, job, i, ids, generated=()):
        """Log-probs of the prompt (the first shown token, with nothing
        before it, gets `None`) and of `generated`, from one scoring pass:
        `(prompt's, generated's)`, each `(values, tops)`, or `None`."""
        if job.request.logprobs is None:
            return None
        scored = self._logprobs(job, list(ids) + list(generated), 1)
        values, tops = scored or ([], [])
        cut = len(ids) - 1
        prompt = (list(values[:cut]), list(tops[:cut]))
        if not job.request.added_start[i]:
            prompt = ([None] + prompt[0], [None] + prompt[1])
        return prompt, (list(values[cut:]), list(tops[cut:]))

    def _send_text(self, job, i, ids, generated, start, text):
        logprobs = None
        if job.request.logprobs is not None and start is not None:
            logprobs = self._logprobs(job, ids + generated, start)
        shown = generated[start - len(ids) :] if start is not None else []
        job.on_event(
            Event("text", i, {"text": text, "ids": shown, "logprobs": logprobs})
        )

    def _finish(self, job, i, ids, generated, reason, text):
        data = {
            "reason": reason,
            "ids": generated,
            "text": text,
            "prompt_text": self._prompt_text(job, i),
            "logprobs": None,
        }
        if not job.request.stream and job.request.logprobs is not None:
            if job.request.echo:
                data["logprobs"] = self._prompt_logprobs(job, i, ids, generated)
            else:
                completion = self._logprobs(job, ids + generated, len(ids))
                data["logprobs"] = (None, completion)
        job.on_event(Event("finish", i, data))
