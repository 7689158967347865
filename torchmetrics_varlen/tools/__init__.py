"""Tooling, not runtime: the demo, the benchmarks, the GPU check, memory measurement and the spawned worker pool.

``import torchmetrics_varlen`` never imports this subpackage; ``python -m torchmetrics_varlen demo|bench`` (and the
``torchmetrics-varlen`` script) import it lazily, and the test-suite uses its worker pool. Nothing in the sync code
depends on it.
"""
