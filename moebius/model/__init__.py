"""Model definitions: the Qwen3-MoE network and the built-in default model config."""
