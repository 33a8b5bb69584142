"""Benchmarks: ``python -m kvcourse.bench NAME``, one module per benchmark.

* ``kernels`` (:mod:`.kernels`) -- chapter 5's decode attention kernels on a GPU: time, effective
  bandwidth, % of the GPU's peak and of a measured device-to-device copy.
* :mod:`.swap` -- chapter 7's swap-vs-recompute micro-benchmark, a function that
  ``benchmarks/bench_offload.py`` and the chapter call (no command of its own).

Benchmarks measure; they never assert a speed in a test. Results that come from a GPU are written with
their provenance (GPU, driver, CUDA, torch, triton) under ``benchmarks/results/``.
"""
