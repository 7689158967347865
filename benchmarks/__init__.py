"""Tooling, not runtime: the demo, the benchmarks, the scale and skew studies, the memory probe and the GPU check.

It lives in the repository, not in the installed package: run it from the repository root (``python -m benchmarks
demo|bench``, ``python -m benchmarks.gpu_check``), with the repository root on ``sys.path``. ``torchmetrics_varlen``
never imports it. The spawned worker pool and the collective meters it measures with are the test-suite's
(``tests/_workers.py``, ``tests/_meters.py``).
"""
