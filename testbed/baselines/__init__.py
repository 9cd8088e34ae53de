"""Baselines on the same devices, network, device models and churn as tile-parallel training:
a GPipe pipeline (DT-FM-style) and data parallelism (optionally DiLoCo). See docs/baselines.md."""
