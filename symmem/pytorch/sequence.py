"""Save rules for sequence ops (norms, activations, attention, embeddings). Filled in by the sequence work."""
