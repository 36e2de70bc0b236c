"""Token-tree speculative inference: trees, drafting, verification, KV caches, the engine."""
