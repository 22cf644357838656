"""Save rules for vision ops (conv, batchnorm, pools, ReLU). Filled in by the pytorch work."""
