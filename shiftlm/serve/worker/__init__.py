"""What every serving rank runs: `runner.ModelRunner` executes each `plan.StepPlan` (rank 0 calls
it, the others follow in `serve_steps`), over `shift_model` (one set of weights, TP and SP x TP
modes), `paged_attention` and its backends, `plan_codec` (the plan as tensors) and `logits`;
`ranks` watches the other ranks; `start` starts and loads a rank."""

# --attention-backend: "auto" (the CPU kernel on CPU where it builds, else gather + SDPA), "cpu-kernel"
# (insist on it), "sdpa" (always gather blocks for SDPA), "flex" (decode rows attend from the cache
# blocks in place with FlexAttention: flex_decode.py); worker/runner.py chooses
ATTENTION_BACKENDS = ("auto", "cpu-kernel", "sdpa", "flex")

__all__ = ["ATTENTION_BACKENDS", "runner", "shift_model", "paged_attention", "stream_attention", "stream_plan", "plan_codec",
           "logits", "compiled_step", "compiled_mixed", "flex_decode", "shift_probe", "ranks", "start"]  # fmt: skip
