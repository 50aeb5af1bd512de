"""LLM: offline batch generation in-process, with vLLM's interface."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from tokenmill.batch import FinishReason
from tokenmill.config import EngineArgs
from tokenmill.engine.engine_core import EngineCore, EngineOutput
from tokenmill.intake import ChildRequest, prepare
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenization.chat_options import ChatTemplateOptions
from tokenmill.tokenization.detokenizer import ChoiceStream
from tokenmill.tokenization.tokenizer import (
    Prompt,
    encode_prompt,
    load_tokenizer,
    render_chat,
    with_bad_words,
)
from tokenmill.vision.images import ImagePreprocessor, image_setup
from tokenmill.vision.inputs import ImageInput


class LLM:
    """An engine in this process: `LLM(model=dir).generate(prompts, SamplingParams(...))`.

    Keyword arguments are the fields of `EngineArgs` (dtype, device, max_num_seqs,
    max_num_batched_tokens, page_size, num_pages or kv_cache_memory_bytes, seed, load_format,
    generation_config, tensor_parallel_size, ...).
    """

    def __init__(self, model: str, **engine_args: Any) -> None:
        args = EngineArgs(model=model, **engine_args)
        self.config = args.create_engine_config()
        self.tokenizer = load_tokenizer(args.tokenizer or model)
        setup = image_setup(self.config.served_model)
        # Offline, an image part may also be a PIL image or a file path.
        self.images = ImagePreprocessor(setup, allow_files=True) if setup is not None else None
        self.engine = EngineCore(self.config)
        self._ids = itertools.count()
        self._children: dict[str, _Child] = {}  # engine request id → its unfinished choice
        # Held while the engine steps or its queue changes: calls from several threads take
        # turns, and an abort that finds it taken (a stream collected mid-step) waits in
        # `_orphans` for the next step.
        self._lock = threading.Lock()
        self._orphans: list[RequestOutput] = []

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (done at exit too); the object is not
        usable after."""
        self.engine.runner.close()

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The checkpoint's tokenizer (None when it has none)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams runs with: the model's generation_config.json
        settings (`--generation-config`), SamplingParams' own for the rest. Its max_tokens is
        None when the model has a default (intake applies it, at most the room left in the
        context), else 16."""
        return self.config.sampling_defaults.sampling_params({})

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt (text or token ids); returns outputs in input order.

        Without `sampling_params`, every prompt runs with `get_default_sampling_params()`.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list | tuple) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, list | tuple):
            raise ValueError(
                "prompts must be a string, a list of token ids or a list of those, got "
                f"{type(prompts).__name__}"
            )
        token_ids = [encode_prompt(self.tokenizer, p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(token_ids, texts, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or several, rendered with the model's chat template.

        With a vision-language model a message's content may be a list of parts: `{"type":
        "text", "text": ...}` and images, as `{"type": "image_url", "image_url": {"url":
        "data:image/png;base64,..."}}` or `{"type": "image", "image": PIL_IMAGE_OR_PATH}`.
        `add_generation_prompt`, `continue_final_message` (the last, assistant message left open
        for the model to continue) and `chat_template_kwargs` (more template variables, e.g.
        Qwen3's `{"enable_thinking": False}`) as vLLM's `LLM.chat`.
        """
        options = ChatTemplateOptions(
            add_generation_prompt, continue_final_message, chat_template_kwargs
        )
        one = isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        if not isinstance(conversations, list) or not all(map(_is_conversation, conversations)):
            raise ValueError("messages must be a list of message dicts or a list of those lists")
        rendered = [
            render_chat(self.tokenizer, c, self.images, options=options) for c in conversations
        ]
        token_ids = [ids for ids, _ in rendered]
        images = [inputs for _, inputs in rendered]
        return self._run(token_ids, [None] * len(token_ids), sampling_params, use_tqdm, images)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Complete one prompt, yielding its output after each engine step that added to it.

        Every yield is the same `RequestOutput`, grown (text and token ids so far, as vLLM's
        cumulative outputs); the last one is finished. Closing the generator early (`close()`,
        or dropping it: a `break` out of `for out in llm.stream(...)` does) aborts the request
        and frees its pages; a stream still referenced after a `break` runs on until closed.
        """
        ids = encode_prompt(self.tokenizer, prompt)
        return self._stream(ids, prompt if isinstance(prompt, str) else None, sampling_params)

    def stream_chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Iterator[RequestOutput]:
        """Answer one conversation (image parts and template options as in `chat`), as
        `stream` does a prompt."""
        if not _is_conversation(messages):
            raise ValueError("messages must be a list of message dicts")
        options = ChatTemplateOptions(
            add_generation_prompt, continue_final_message, chat_template_kwargs
        )
        ids, images = render_chat(self.tokenizer, messages, self.images, options=options)
        return self._stream(ids, None, sampling_params, images)

    def flush_prefix_cache(self) -> int:
        """Drop cached prefixes no request is using; returns the number of pages freed."""
        return self.engine.cache.flush()

    def _run(
        self,
        token_ids: list[list[int]],
        texts: list[str | None],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        images: list[tuple[ImageInput, ...]] | None = None,
    ) -> list[RequestOutput]:
        params = self._per_prompt(sampling_params, len(token_ids))
        results = self._add(token_ids, texts, params, images)
        bar = tqdm(total=len(results), desc="Generating", disable=not use_tqdm or len(results) < 2)
        done = 0
        try:
            while done < len(results):
                self._step()
                finished = sum(r.finished for r in results)
                bar.update(finished - done)
                done = finished
        except BaseException:
            # Interrupted (KeyboardInterrupt, an error in a step or a callback): nobody will
            # read these, so they must not keep running nor hold pages.
            self._abort(results)
            raise
        finally:
            bar.close()
        return results

    def _stream(
        self,
        token_ids: list[int],
        text: str | None,
        sampling_params: SamplingParams | None,
        images: tuple[ImageInput, ...] = (),
    ) -> Iterator[RequestOutput]:
        params = self._per_prompt(sampling_params, 1)
        # Checked here, not at the first next(): a bad request fails where it is made.
        (result,) = self._add([token_ids], [text], params, [images])
        return _Stream(self, result)

    def _follow(self, result: RequestOutput) -> Iterator[RequestOutput]:
        try:
            finished = False
            while not finished:
                # Finished already: by the steps of another caller (`generate`, another
                # stream), whose last change this stream has not yielded yet.
                if result.finished or any(r is result for r in self._step()):
                    finished = result.finished
                    yield result
        finally:
            self._abort([result])

    def _abort(self, results: Sequence[RequestOutput]) -> None:
        """Abort the requests of `results`' choices still unfinished: now, or at the next step
        when the engine is busy (this runs from garbage collection too, maybe inside a step)."""
        if not self._lock.acquire(blocking=False):
            self._orphans.extend(results)
            return
        try:
            self._abort_now(results)
        finally:
            self._lock.release()

    def _abort_now(self, results: Sequence[RequestOutput]) -> None:
        """`_abort`, with the lock held."""
        ids = {id(r) for r in results}
        for child_id in [i for i, c in self._children.items() if id(c.result) in ids]:
            self.engine.abort_request(child_id)
            del self._children[child_id]

    def _add(
        self,
        token_ids: list[list[int]],
        texts: list[str | None],
        params: list[SamplingParams],
        images: list[tuple[ImageInput, ...]] | None = None,
    ) -> list[RequestOutput]:
        """Queue one request per prompt (with its images); returns their outputs, filled in by
        `_step`."""
        limits = self.engine.limits
        images = images or [()] * len(token_ids)
        # Every prompt is checked before any is queued, so a bad one leaves the engine idle.
        prepared = []
        for ids, text, p, inputs in zip(token_ids, texts, params, images, strict=True):
            request_id = str(next(self._ids))
            children = prepare(
                request_id, ids, with_bad_words(self.tokenizer, p), limits, bool(inputs)
            )
            # The prompt the model sees (truncated where `truncate_prompt_tokens` says).
            result = RequestOutput(request_id, text, children[0].prompt_token_ids, [])
            prepared.append((result, children, inputs))
            if p.structured_outputs is not None:
                # Compiled now (the engine reuses it): a constraint no token can start raises.
                self.engine.grammar_compiler.submit(p.structured_outputs).result()
        with self._lock:
            self._queue(prepared)
        return [result for result, _, _ in prepared]

    def _queue(
        self, prepared: list[tuple[RequestOutput, list[ChildRequest], tuple[ImageInput, ...]]]
    ) -> None:
        """Add checked requests to the engine (with the lock held), each choice as its own."""
        for result, engine_requests, inputs in prepared:
            for index, child in enumerate(engine_requests):
                logprobs = [] if child.params.logprobs is not None else None
                completion = CompletionOutput(index, logprobs=logprobs)
                result.outputs.append(completion)
                stream = ChoiceStream(self.tokenizer, child.prompt_token_ids, child.params)
                self._children[child.request_id] = _Child(result, completion, stream)
                self.engine.add_request(
                    child.request_id, child.prompt_token_ids, child.params, inputs, checked=True
                )

    def _step(self) -> list[RequestOutput]:
        """One engine step, applied; returns the requests it added to (each once)."""
        with self._lock:
            orphans, self._orphans = self._orphans, []
            self._abort_now(orphans)
            return self._step_now()

    def _step_now(self) -> list[RequestOutput]:
        """`_step`, with the lock held."""
        touched: dict[int, RequestOutput] = {}
        for out in self.engine.step():
            child = self._children[out.request_id]
            if child.apply(out):  # a stop string ended it: the engine reports "stop"
                final = self.engine.abort_request(out.request_id, FinishReason.STOP)
                if final is not None:
                    child.apply(final)
            if child.completion.finished:
                del self._children[out.request_id]
            touched[id(child.result)] = child.result
        return list(touched.values())

    def _per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if not isinstance(sampling_params, list | tuple) or not all(
            isinstance(p, SamplingParams) for p in sampling_params
        ):
            raise ValueError("sampling_params must be a SamplingParams or a list of them")
        if len(sampling_params) != count:
            raise ValueError(
                f"sampling_params has {len(sampling_params)} entries for {count} prompts"
            )
        return list(sampling_params)


def _is_conversation(messages: object) -> bool:
    return isinstance(messages, list) and all(isinstance(m, dict) for m in messages)


class _Stream(Iterator[RequestOutput]):
    """`LLM.stream`'s iterator: a generator closed before its first `next()` runs no
    `finally`, so `close()` also aborts the request here (it was queued when the stream was
    made)."""

    def __init__(self, llm: LLM, result: RequestOutput) -> None:
        self._llm, self._result = llm, result
        self._follow = llm._follow(result)

    def __next__(self) -> RequestOutput:
        return next(self._follow)

    def close(self) -> None:
        self._follow.close()
        self._llm._abort([self._result])

    def __del__(self) -> None:
        # Dropped unread: its request was queued when the stream was made.
        self.close()


@dataclasses.dataclass
class _Child:
    """One of a request's `n` completions while it is generated."""

    result: RequestOutput
    completion: CompletionOutput
    stream: ChoiceStream

    def apply(self, out: EngineOutput) -> bool:
        """Add a step's tokens; True if a stop string ended the completion before the engine."""
        reason = out.finish_reason.value if out.finish_reason is not None else None
        update = self.stream.update(out.new_token_ids, reason)
        self.result.num_cached_tokens = max(self.result.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None and self.result.prompt_logprobs is None:
            self.result.prompt_logprobs = out.prompt_logprobs  # every choice has the same
        if update is None:
            return False
        completion = self.completion
        completion.token_ids.extend(update.token_ids)
        if completion.logprobs is not None and update.token_ids and out.new_logprobs:
            completion.logprobs.extend(out.new_logprobs[: len(update.token_ids)])
        completion.text = self.stream.text
        completion.finish_reason = update.finish_reason
        return update.stop_matched
