"""The live EP <-> TP switch: pure plans, the transport, and the ordered per-layer execution."""
