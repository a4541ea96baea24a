"""Layer 8: the frameworks that drive a zerodist engine from where users train.

- `zerodist.integrations.transformers.ZerodistTrainer`: Hugging Face's `Trainer`, every step
  through the engine (`pip install 'zerodist[hf]'`).

Each module imports its framework when it is imported itself, never before: the frameworks are
optional extras, and `import zerodist.integrations` needs none of them.
"""
