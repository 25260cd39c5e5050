"""The engine: config, loading, tokenizer, hand-written Llama forward, KV cache, sessions, sampling, FLOPs."""
