"""Parallel training and inference helpers built on jaxring's collectives.

- :mod:`jaxring.parallel.data`: data parallelism (fused gradient buckets, a distributed optimizer).
- :mod:`jaxring.parallel.pipeline`: layer-sharded pipelines over point-to-point transfers.
"""
