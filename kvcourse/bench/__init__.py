"""Benchmarks: ``python -m kvcourse.bench NAME``, one module per benchmark.

* ``kernels`` (:mod:`.kernels`) -- chapter 5's decode attention kernels on a GPU: time, effective
  bandwidth, % of the GPU's peak and of a measured device-to-device copy.
* :mod:`.swap` -- chapter 7's swap-vs-recompute micro-benchmark, a function that
  ``benchmarks/bench_offload.py`` and the chapter call (no command of its own).

The tools that measure chapter 5's kernels (kernels themselves live in :mod:`kvcourse.kernels`, and
never import these):

* :mod:`.measured` -- the committed GPU runs of ``python -m kvcourse.bench kernels`` (the first: an
  NVIDIA H200), read, checked and plotted against torch's SDPA, the vendor peak and a measured copy;
  :func:`~.measured.check_result` validates any committed result file of a kind the package reads.
* :mod:`.provenance` -- where a page's kernel numbers came from: how every launch ran, and the committed
  GPU measurements (or, where there are none, the floor that vendor peak bandwidth sets).
* :mod:`.compile_check` -- the kernels compiled for a T4, an A100 and an H100 without a GPU: registers,
  spills, shared memory, tensor-core instructions or not (``python -m kvcourse.bench.compile_check``).
* :mod:`.instructions` -- the int8 kernel's SASS instruction counts for an H100, compiled on a CPU
  (``python -m kvcourse.bench.instructions``).
* :mod:`.launch_count` -- the kernels one engine decode step launches, counted on a CPU (Triton's interpreter and
  a dispatch-mode counter; ``python -m kvcourse.bench.launch_count [--unfused]``).

Benchmarks measure; they never assert a speed in a test. Results that come from a GPU are written with
their provenance (GPU, driver, CUDA, torch, triton) under ``benchmarks/results/``.
"""
