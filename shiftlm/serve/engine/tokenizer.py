"""Tokenizers for serving: the checkpoint's own (Hugging Face format), or a character tokenizer that
tests and benchmarks write next to tiny random checkpoints (which ship none)."""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path

from shiftlm.errors import ConfigError
from shiftlm.serve.engine.errors import InvalidRequest

CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


# apply_chat_template's own arguments: not template variables a request may set
_RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
             "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
             "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}  # fmt: skip


def choose_chat_template(tokenizer, *chosen: str | None) -> str | None:
    """The first template given (a request's, then the server's --chat-template), else the
    tokenizer's own (None: the model has none)."""
    return next((t for t in chosen if t), None) or getattr(tokenizer, "chat_template", None)


def chat_messages(conversation, where: str = "") -> list[dict]:
    """OpenAI chat messages (dicts) as chat templates take them: content as plain text (OpenAI's
    text parts joined), `name` and `tool_call_id` kept, and each assistant tool call's `arguments`
    (a JSON string on the wire) parsed into the dict that templates expect, as vLLM passes them. The
    server's messages and `LLM.chat`'s both come here; `where` prefixes the errors."""
    if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence) or not conversation:
        raise InvalidRequest(f"{where}a conversation is a non-empty list of messages", "messages")
    return [_chat_message(message, f"{where}message {j}") for j, message in enumerate(conversation)]


def _chat_message(message, where: str) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidRequest(f"{where} is not a {{'role': ..., 'content': ...}} dict", "messages")
    content = message.get("content") or ""
    if not isinstance(content, str):  # OpenAI's content parts: only text ones
        try:
            if any(part["type"] != "text" for part in content):
                raise KeyError("type")
            content = "".join(part["text"] for part in content)
        except (TypeError, KeyError):
            raise InvalidRequest(
                f"{where}: content is text or a list of {{'type': 'text', 'text': ...}} parts", "messages"
            ) from None
    out = {"role": message["role"], "content": content}
    out.update({k: message[k] for k in ("name", "tool_call_id") if message.get(k) is not None})
    if message.get("tool_calls"):
        out["tool_calls"] = [
            _tool_call(call, f"{where}: tool call {i}") for i, call in enumerate(message["tool_calls"])
        ]
    return out


def _tool_call(call, where: str) -> dict:
    try:
        function = call["function"]
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict) or not isinstance(function["name"], str):
            raise ValueError
    except (TypeError, KeyError, AttributeError, ValueError):
        raise InvalidRequest(
            f"{where} needs function.name and function.arguments, a JSON object", "messages"
        ) from None
    return {**call, "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def render_chat(
    tokenizer,
    messages: list[dict],
    template: str,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> str:
    """One conversation (`chat_messages`) as the prompt text the chat template makes of it: the
    server's /v1/chat/completions and /tokenize and `LLM.chat` all render here. `continue_final_message`:
    the last (assistant) message is left open for the model to continue (vLLM's and transformers'
    flag); `template_kwargs`: more template variables (vLLM's `chat_template_kwargs`, e.g. Qwen3's
    `enable_thinking`); `tools`: OpenAI's tool definitions, for the templates that describe them."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message continues the last message: send add_generation_prompt: false with it",
            "continue_final_message",
        )
    reserved = sorted(_RESERVED & set(template_kwargs or {}))
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template=template,
        **(template_kwargs or {}),
    )


def think_tokens(tokenizer) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` if each is one token of this vocabulary (reasoning models')."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in ("<think>", "</think>")]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


def opens_thinking(prompt_ids, think: tuple[int, int] | None) -> bool:
    """Whether the prompt leaves a thinking block open (its last think tag is `<think>`), as the
    templates of DeepSeek-R1's distills, QwQ and Qwen3's *-Thinking models end a prompt."""
    if think is None:
        return False
    last = {token: i for i, token in enumerate(prompt_ids) if token in think}
    return last.get(think[0], -1) > last.get(think[1], -1)


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer (`AutoTokenizer`); a clear error if the directory has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(
            f"no usable tokenizer in {model_dir} ({type(err).__name__}); add tokenizer files "
            "(tokenizer.json / tokenizer_config.json) or write one with shiftlm.serve.engine.tokenizer.write_char_tokenizer"
        ) from None


def write_char_tokenizer(model_dir: str | Path, vocab_size: int, eos_token_id: int = 2) -> None:
    """Save a one-character-per-token tokenizer with a chat template; ids past the alphabet decode as
    `<t{id}>` so that any token a random model emits is printable."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {0: "<unk>", 1: "<s>", eos_token_id: "</s>"}
    alphabet = iter(string.ascii_letters + string.digits + " .,!?:;'\"-()\n<>|/")
    vocab = {}
    for token_id in range(vocab_size):
        vocab[specials.get(token_id) or next(alphabet, f"<t{token_id}>")] = token_id
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(model_dir))
