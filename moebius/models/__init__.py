"""Model families: one folder a family (its config, weight specs, KV spec and layout-free forward), found through
`registry.py` by the checkpoint's `architectures`."""
