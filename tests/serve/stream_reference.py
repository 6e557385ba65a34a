"""Greedy multi-stream references computed with Hugging Face `transformers` alone, independently of
shiftlm's mask code: the rules are written out here token by token.

Streams advance in lockstep. At timestep t every live stream writes one token: its own prefix token
while it has one, else the argmax of the logits of its token at t-1 (at t = 0: of the prompt's last
token). A stream stops after `max_tokens[k]` generated tokens (its last token stays visible).

- timestep / isolated: ONE forward per timestep over all tokens so far, in interleaved order, with an
  explicit 4-D attention mask and `position_ids` (prompt: index; stream token t: prompt_len + t).
- hogwild: each token is computed once, in its worker's own view at the time (prompt, the other
  workers' tokens contiguous in worker order, its own last, positions counted along the view), and
  its K/V stay; a single forward cannot express that (a key's position differs per viewer), so the
  reference re-encodes keys instead of rotating queries: per token, a `DynamicCache` holding the
  visible tokens' pre-RoPE K (captured from `k_proj`) rotated by HF's own rotary embedding at the
  view's positions, and V, then one HF forward of the token at its view position.
"""

from __future__ import annotations

import torch


def _lockstep(prefixes, max_tokens, next_tokens):
    """Drive the lockstep rule; `next_tokens(t, writers_prev)` -> {stream: argmax logits of its row}."""
    streams = len(prefixes)
    outputs = [[] for _ in range(streams)]
    written = [[] for _ in range(streams)]
    t = 0
    while True:
        live = [k for k in range(streams) if len(outputs[k]) < max_tokens[k]]
        if not live:
            return outputs
        need = [k for k in live if t >= len(prefixes[k])]
        logits_of = next_tokens(t, need, written) if need else {}
        for k in live:
            token = prefixes[k][t] if t < len(prefixes[k]) else logits_of[k]
            if t >= len(prefixes[k]):
                outputs[k].append(token)
            written[k].append(token)
        t += 1


def timestep_reference(model, prompt, prefixes, max_tokens, layout="timestep"):
    """Greedy outputs per stream, one HF forward per timestep with a 4-D mask and position_ids."""

    def next_tokens(t, need, written):
        tags = [(-1, p) for p in range(len(prompt))]
        ids = list(prompt)
        for tau in range(t):
            for k in range(len(prefixes)):
                if tau < len(written[k]):
                    tags.append((k, tau))
                    ids.append(written[k][tau])
        n = len(ids)
        mask = torch.full((1, 1, n, n), torch.finfo(torch.float32).min)
        for qi, (qs, qt) in enumerate(tags):
            for ki, (ks, kt) in enumerate(tags):
                if qs == -1:
                    visible = ks == -1 and kt <= qt
                elif ks == -1:
                    visible = True
                elif layout == "isolated":
                    visible = ks == qs and kt <= qt
                else:
                    visible = kt < qt or (ks == qs and kt == qt)
                if visible:
                    mask[0, 0, qi, ki] = 0.0
        positions = [tt if s == -1 else len(prompt) + tt for s, tt in tags]
        with torch.no_grad():
            logits = model(
                torch.tensor([ids]), attention_mask=mask, position_ids=torch.tensor([positions])
            ).logits[0]
        result = {}
        for k in need:
            row = len(prompt) - 1 if t == 0 else tags.index((k, t - 1))
            result[k] = int(torch.argmax(logits[row]))
        return result

    return _lockstep(prefixes, max_tokens, next_tokens)


class _RawKV:
    """Pre-RoPE K and V of every layer, captured from k_proj / v_proj outputs."""

    def __init__(self, model):
        self.model, self.k, self.v = model, {}, {}
        self.hooks = []
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            self.hooks.append(attn.k_proj.register_forward_hook(self._store(self.k, i, attn)))
            self.hooks.append(attn.v_proj.register_forward_hook(self._store(self.v, i, attn)))

    def _store(self, into, layer, attn):
        def hook(_module, _inputs, output):
            into[layer] = output[0].view(output.shape[1], -1, attn.head_dim)  # [T, Hkv, D]

        return hook


def _cache_argument(model) -> str:
    """The forward's name for a KV cache: `cache` in newer transformers, `past_key_values` before (an
    older forward takes `cache=` into its **kwargs and silently runs without it)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hogwild_reference(model, prompt, prefixes, max_tokens):
    """Greedy outputs per stream with the hogwild contiguous layout, keys re-encoded per view."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import rotate_half

    raw = _RawKV(model)
    layers = len(model.model.layers)
    with torch.no_grad():
        model(torch.tensor([prompt]))  # fills raw.k / raw.v with the prompt's
    prompt_kv = [(raw.k[i].clone(), raw.v[i].clone()) for i in range(layers)]
    token_kv: dict[tuple[int, int], list] = {}  # (stream, t) -> per layer (k, v), pre-RoPE
    last_logits: dict[int, torch.Tensor] = {}

    def forward_token(k, t, token, written):
        others = [j for j in range(len(prefixes)) if j != k]
        keys = [(j, tau) for j in others for tau in range(min(t, len(written[j])))]
        keys += [(k, tau) for tau in range(t)]
        positions = list(range(len(prompt))) + [len(prompt) + i for i in range(len(keys))]
        cos, sin = model.model.rotary_emb(torch.zeros(1, 1), torch.tensor([positions]))
        cache = DynamicCache()
        for i in range(layers):
            k_raw = torch.cat([prompt_kv[i][0]] + [token_kv[key][i][0] for key in keys])
            v_raw = torch.cat([prompt_kv[i][1]] + [token_kv[key][i][1] for key in keys])
            k_raw, v_raw = k_raw.transpose(0, 1)[None], v_raw.transpose(0, 1)[None]  # [1, Hkv, T, D]
            k_rot = k_raw * cos[:, None] + rotate_half(k_raw) * sin[:, None]
            cache.update(k_rot, v_raw, i)
        with torch.no_grad():
            out = model(
                torch.tensor([[token]]),
                position_ids=torch.tensor([[len(positions)]]),
                **{_cache_argument(model): cache},
            )
        token_kv[(k, t)] = [(raw.k[i].clone(), raw.v[i].clone()) for i in range(layers)]
        last_logits[k] = out.logits[0, -1]

    with torch.no_grad():
        prompt_logits = model(torch.tensor([prompt])).logits[0, -1]
    computed = [0]

    def next_tokens(t, need, written):
        # compute every token written before t (each in its own view), then read the needed logits
        for tau in range(computed[0], t):
            for k in range(len(prefixes)):
                if tau < len(written[k]):
                    forward_token(k, tau, written[k][tau], written)
        computed[0] = t
        return {k: int(torch.argmax(prompt_logits if t == 0 else last_logits[k])) for k in need}

    try:
        return _lockstep(prefixes, max_tokens, next_tokens)
    finally:
        for hook in raw.hooks:
            hook.remove()


def make_position_sensitive_checkpoint(path, seed: int = 0):
    """A tiny random Llama (4 heads of 16, 2 KV heads, rope_theta 20, scaled-up q/k) whose greedy
    tokens depend on relative positions: with the shared tiny presets (head_dim 8, theta 1e4 or 5e5)
    hogwild's re-laid positions rarely change an argmax, so a test could not tell it from timestep."""
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=250,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=20.0,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            if "q_proj" in name or "k_proj" in name:
                param.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_model(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def reference(model, layout, prompt, prefixes, max_tokens):
    if layout == "hogwild":
        return hogwild_reference(model, prompt, prefixes, max_tokens)
    return timestep_reference(model, prompt, prefixes, max_tokens, layout)
