"""Layer 8: the frameworks that drive a zerodist engine from where users train.

- `zerodist.integrations.transformers.ZerodistTrainer`: Hugging Face's `Trainer`, every step
  through the engine (`pip install 'zerodist[hf]'`).
- `zerodist.integrations.as_deepspeed`: `import deepspeed` served by zerodist, so tools used
  unchanged (llamafactory-cli, trl, a Trainer with `deepspeed=`, accelerate) train on zerodist
  through transformers' and accelerate's own DeepSpeed path (`zerodist run --as-deepspeed`).
- `zerodist.integrations.lightning.ZerodistStrategy`: Lightning's `Trainer(strategy=...)`, also by
  the names "zerodist", "zerodist_stage_1/2/3" once imported (`pip install 'zerodist[lightning]'`).

Each module imports its framework when it is imported itself, never before: the frameworks are
optional extras, and `import zerodist.integrations` needs none of them.
"""
