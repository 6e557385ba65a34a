"""The offline batch API, as vLLM users write it, over the serving engine:

    from shiftlm import LLM, SamplingParams

    llm = LLM("path/to/checkpoint", tp=2, sp=1)
    for out in llm.generate(["Hello, my name is", "The capital of France is"],
                            SamplingParams(temperature=0.0, max_tokens=32)):
        print(out.prompt, out.outputs[0].text)
    llm.close()  # or `with LLM(...) as llm:`

The same setup as `shiftlm serve` (`ServeOptions.resolve`: the checkpoint, layout, device and dtype
checked before any rank starts; tp x sp local ranks started as the server starts them), the same
engine and scheduler; only the HTTP front is left out. Every prompt is checked before any is queued,
so a bad one raises `InvalidRequest` naming it and nothing runs. A batch that raises or is interrupted
midway (Ctrl-C in a notebook) aborts its requests, so the next call starts from an empty engine.

    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))
    json_only = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

from shiftlm.serve.engine.errors import InvalidRequest
from shiftlm.serve.engine.sampling import TokenLogprob
from shiftlm.serve.engine.sequence import SamplingParams
from shiftlm.serve.engine.structured import StructuredOutputsParams
from shiftlm.serve.engine.tokenizer import chat_messages, choose_chat_template, render_chat
from shiftlm.serve.options import ServeOptions
from shiftlm.serve.server import build_engine, measure_shift_threshold
from shiftlm.serve.worker.start import start_ranks, stop_local_ranks

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "CompletionOutput", "GenerationOutput"]


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's `CompletionOutput`)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class GenerationOutput:
    """What `LLM.generate` returns per prompt, in prompt order (vLLM's `RequestOutput`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finished: bool = True


class LLM:
    """A model on tp x sp local ranks, generating for batches of prompts. Keyword arguments are the
    options of `shiftlm serve` (`ServeOptions`: `dtype`, `max_model_len`, `num_blocks`, `block_size`,
    `max_num_seqs`, `max_tokens_per_step`, `mode`, `shift_threshold`, `enforce_eager`, `seed`, ...);
    vLLM's `tensor_parallel_size` is accepted for `tp`."""

    def __init__(
        self, model: str, tp: int = 1, sp: int = 1, tensor_parallel_size: int | None = None, **options
    ):
        options.pop("trust_remote_code", None)  # accepted as vLLM accepts it: shiftlm runs only its own code
        tp = tensor_parallel_size or tp
        unknown = sorted(set(options) - set(ServeOptions.__dataclass_fields__))
        if unknown:
            raise TypeError(f"LLM() got unknown options {unknown}: see shiftlm serve --help for the options")
        # the ranks are this process's own children, whatever a launcher's environment says
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        setup = ServeOptions(model=str(model), tp=tp, sp=sp, **options).resolve(env)
        self._runner, self._workers = start_ranks(setup.runner, 0, False)
        self._closed = False
        try:
            if setup.scheduler is None:  # a GPU cache sized by the ranks from what memory left
                setup = setup.with_kv_blocks(self._runner.cache.num_blocks)
            setup = measure_shift_threshold(self._runner, setup)
            self._engine = build_engine(self._runner, setup)
        except BaseException:
            self.close()
            raise
        self.setup = setup
        self.tokenizer = setup.tokenizer
        self._ids = 0

    def generate(
        self,
        prompts: str | dict | Seq[str | dict] | Seq[int] | Seq[Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Seq[int] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text, token ids, or vLLM's `{"prompt": text}` /
        `{"prompt_token_ids": ids}`); one `SamplingParams` for all or one per
        prompt (default: `SamplingParams()`, sampling at temperature 1 for 16 tokens, as vLLM's). Returns
        when all are done; `use_tqdm` writes a progress line to stderr. `priority`: one per prompt
        (lower first) with `scheduling_policy="priority"`, as vLLM's."""
        texts, token_ids = self._prompts(prompts)
        if priority is not None:
            if len(priority) != len(token_ids):
                raise InvalidRequest(f"{len(priority)} priorities for {len(token_ids)} prompts", "priority")
            params = self._params(sampling_params, len(token_ids))
            sampling_params = [replace(p, priority=level) for p, level in zip(params, priority)]
        return self._generate(texts, token_ids, sampling_params, use_tqdm)

    def _generate(self, texts, token_ids, sampling_params, use_tqdm: bool) -> list[GenerationOutput]:
        if self._closed:
            raise RuntimeError("this LLM is closed")
        params = self._params(sampling_params, len(token_ids))
        engine = self._engine
        # vLLM's max_tokens=None: as many as the context leaves after the prompt
        params = [
            replace(p, max_tokens=engine.max_tokens_left(len(ids), p.n)) if p.max_tokens is None else p
            for ids, p in zip(token_ids, params)
        ]
        for i, (ids, p) in enumerate(zip(token_ids, params)):
            try:
                engine.check_request(ids, p)
            except InvalidRequest as err:
                raise InvalidRequest(f"prompt {i}: {err}", err.param) from None
        names = [f"offline-{self._ids + i}" for i in range(len(token_ids))]
        self._ids += len(names)
        results = {
            name: GenerationOutput(name, text, ids, [CompletionOutput(k) for k in range(p.n)])
            for name, text, ids, p in zip(names, texts, token_ids, params)
        }
        try:
            for name, ids, p in zip(names, token_ids, params):
                engine.enqueue(name, ids, p)
            self._run(results, use_tqdm)
        except BaseException:  # an error or Ctrl-C: nothing of this batch is left to run in the next call
            for name in names:
                engine.abort(name)
            raise
        return [results[name] for name in names]

    def chat(
        self,
        messages: Seq[dict] | Seq[Seq[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[GenerationOutput]:
        """Generate a reply to one conversation (a list of `{"role": ..., "content": ...}` messages) or
        to each of a list of conversations, rendered by the chat template as the server's
        /v1/chat/completions renders them (`chat_template`, else the `chat_template` option as
        `shiftlm serve --chat-template` takes it, else the tokenizer's own). `content` is text or OpenAI's
        `[{"type": "text", "text": ...}]`; assistant `tool_calls` and `tool` messages as OpenAI sends
        them; `tools`: OpenAI's tool definitions, for templates that describe them (the reply is
        text: as vLLM's `LLM.chat`, nothing parses calls out of it)."""
        if self._closed:
            raise RuntimeError("this LLM is closed")
        template = choose_chat_template(self.tokenizer, chat_template, self.setup.api.chat_template)
        if not template:
            raise InvalidRequest(
                "the model has no chat template: pass chat_template=..., or use generate() with plain prompts",
                "chat_template",
            )
        is_one = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if is_one else list(messages)
        if not conversations:
            raise InvalidRequest("no conversations given", "messages")
        texts, token_ids = [], []
        for i, conversation in enumerate(conversations):
            where = "" if is_one else f"conversation {i}: "
            texts.append(
                render_chat(
                    self.tokenizer,
                    chat_messages(conversation, where),
                    template,
                    add_generation_prompt,
                    continue_final_message,
                    chat_template_kwargs,
                    tools,
                )
            )
            # the template writes the special tokens it wants (as the server encodes it)
            token_ids.append(self.tokenizer.encode(texts[-1], add_special_tokens=False))
        return self._generate(texts, token_ids, sampling_params, use_tqdm)

    def _run(self, results: dict[str, GenerationOutput], use_tqdm: bool) -> None:
        """Step the engine until it has nothing left, filling in `results` as the outputs come."""
        engine = self._engine
        done, started = 0, time.monotonic()
        while engine.has_work():
            for out in engine.step():
                result = results[out.request_id]
                sample = result.outputs[out.index]
                sample.text += out.text
                sample.token_ids += out.token_ids
                if out.logprobs is not None:
                    sample.logprobs = (sample.logprobs or []) + [out.logprobs]
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                if out.finish_reason is not None:
                    sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
                    done += all(s.finish_reason is not None for s in result.outputs)
            failed = engine.take_failed()
            if failed:
                request_id, trace = failed[0]
                raise RuntimeError(f"request {request_id} failed: {trace.strip().splitlines()[-1]}")
            if use_tqdm:
                print(
                    f"\rshiftlm: {done}/{len(results)} prompts done, {time.monotonic() - started:.1f} s",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
        if use_tqdm:
            print(file=sys.stderr)

    def _prompts(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif prompts and all(isinstance(t, int) for t in prompts):
            prompts = [list(prompts)]  # one prompt of token ids
        texts, token_ids = [], []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
                unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
                if unknown or len(prompt) != 1:
                    raise InvalidRequest(
                        f"prompt {i}: a dict prompt has one key, 'prompt' (text) or 'prompt_token_ids' "
                        f"(got {sorted(prompt)})",
                        "prompts",
                    )
                prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
            if isinstance(prompt, str):
                texts.append(prompt)
                token_ids.append(self.tokenizer.encode(prompt))
            elif isinstance(prompt, Seq) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt
            ):
                texts.append(None)
                token_ids.append([int(t) for t in prompt])
            else:
                raise InvalidRequest(
                    f"prompt {i} is a {type(prompt).__name__}: give text, a list of token ids, or "
                    "{'prompt': text} / {'prompt_token_ids': ids}",
                    "prompts",
                )
        if not token_ids:
            raise InvalidRequest("no prompts given", "prompts")
        return texts, token_ids

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: `SamplingParams()` with the model's generation_config.json defaults (what a call
        without sampling_params uses)."""
        return SamplingParams(**dict(self.setup.api.sampling_defaults))

    def _params(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * count
        else:
            params = list(sampling_params)
            if len(params) != count:
                raise InvalidRequest(
                    f"{len(params)} SamplingParams for {count} prompts: give one, or one per prompt",
                    "sampling_params",
                )
        # vLLM's spellings: a single stop string, top_k = -1 for "no top-k"
        return [
            replace(
                p,
                stop=(p.stop,) if isinstance(p.stop, str) else tuple(p.stop),
                stop_token_ids=tuple(p.stop_token_ids),
                top_k=0 if p.top_k == -1 else p.top_k,
                logit_bias=tuple(p.logit_bias.items()) if isinstance(p.logit_bias, dict) else p.logit_bias,
            )
            for p in params
        ]

    def get_tokenizer(self):
        """The checkpoint's tokenizer (vLLM's `LLM.get_tokenizer`)."""
        return self.tokenizer

    def close(self) -> None:
        """Stop the other ranks (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._workers:
            self._runner.stop_workers()
        stop_local_ranks(self._workers)
        if self._workers:  # this process was rank 0 of the group: leave it, so another LLM can start
            import torch.distributed as dist

            from shiftlm.comm import shm

            shm.disable_all()
            dist.destroy_process_group()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
