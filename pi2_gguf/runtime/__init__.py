"""Running models with the PI2 plugin: the plugin's C API, pi2_gguf.Llama, greedy decoding and memory budgets."""
