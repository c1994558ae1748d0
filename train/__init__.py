"""Training pipelines: fine-tune the oracle, distil the draft (accelerate)."""
