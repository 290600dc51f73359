"""The DeepSeek-V2 / V3 family (DeepSeek-V2-Lite, Moonlight, DeepSeek-V3 / R1, Kimi K2): multi-head latent
attention, shared experts, grouped routing."""
