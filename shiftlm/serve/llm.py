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
so a bad one raises `InvalidRequest` naming it and nothing runs.
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
from shiftlm.serve.options import ServeOptions
from shiftlm.serve.server import build_engine, measure_shift_threshold
from shiftlm.serve.worker.start import start_ranks, stop_local_ranks

__all__ = ["LLM", "SamplingParams", "CompletionOutput", "GenerationOutput"]


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's `CompletionOutput`)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


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
        prompts: str | Seq[str] | Seq[int] | Seq[Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text, or token ids); one `SamplingParams` for all or one per
        prompt (default: greedy-free sampling of 16 tokens, as vLLM's default). Returns when all are done;
        `use_tqdm` writes a progress line to stderr."""
        if self._closed:
            raise RuntimeError("this LLM is closed")
        texts, token_ids = self._prompts(prompts)
        params = self._params(sampling_params, len(token_ids))
        engine = self._engine
        for i, (ids, p) in enumerate(zip(token_ids, params)):
            try:
                engine.check_request(ids, p)
            except InvalidRequest as err:
                raise InvalidRequest(f"prompt {i}: {err}", err.param) from None
        names = []
        for ids, p in zip(token_ids, params):
            names.append(f"offline-{self._ids}")
            self._ids += 1
            engine.enqueue(names[-1], ids, p)
        results = {
            name: GenerationOutput(name, text, ids, [CompletionOutput(k) for k in range(p.n)])
            for name, text, ids, p in zip(names, texts, token_ids, params)
        }
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
                    sample.finish_reason = out.finish_reason
                    done += all(s.finish_reason is not None for s in result.outputs)
            failed = engine.take_failed()
            if failed:
                request_id, trace = failed[0]
                raise RuntimeError(f"request {request_id} failed: {trace.strip().splitlines()[-1]}")
            if use_tqdm:
                print(
                    f"\rshiftlm: {done}/{len(names)} prompts done, {time.monotonic() - started:.1f} s",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
        if use_tqdm:
            print(file=sys.stderr)
        return [results[name] for name in names]

    def _prompts(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        elif prompts and all(isinstance(t, int) for t in prompts):
            prompts = [list(prompts)]  # one prompt of token ids
        texts, token_ids = [], []
        for prompt in prompts:
            if isinstance(prompt, str):
                texts.append(prompt)
                token_ids.append(self.tokenizer.encode(prompt))
            else:
                texts.append(None)
                token_ids.append([int(t) for t in prompt])
        if not token_ids:
            raise InvalidRequest("no prompts given", "prompts")
        return texts, token_ids

    @staticmethod
    def _params(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * count
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
                top_k=0 if p.top_k == -1 else p.top_k,
                logit_bias=tuple(p.logit_bias.items()) if isinstance(p.logit_bias, dict) else p.logit_bias,
            )
            for p in params
        ]

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
