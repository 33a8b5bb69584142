"""Shared fixtures: the real model and tokenizer (ours and Hugging Face's), loaded once per session."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from hypothesis import settings

import kvcourse

# Property tests draw the same examples on every machine and in every run: a failure in CI is a
# failure here. (derandomize: examples come from each test's own name, not from a random seed.)
settings.register_profile("kvcourse", derandomize=True, database=None, deadline=None)
settings.load_profile("kvcourse")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:\n1.",
]


def tiny_llama(seed: int, **config) -> kvcourse.LlamaModel:
    """A tiny random-weight Llama (2 layers, GQA 6:2, head_dim 8) for fast tests; ``config`` overrides its shape."""
    shape = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=8, rope_theta=10000.0, max_position_embeddings=1024)  # fmt: skip
    model = kvcourse.LlamaModel(kvcourse.LlamaConfig(**(shape | config)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """``KVCOURSE_PACKAGE_ON_META=1``: every test runs with the package's device-less tensors on meta
    (``tests/meta_device.py``), so a device bug fails on a CPU too. Fixtures are built as usual."""
    if os.environ.get("KVCOURSE_PACKAGE_ON_META") != "1":
        return (yield)
    from .meta_device import package_on_meta

    with package_on_meta():
        return (yield)


# Grading runs the graded code under bubblewrap (kvcourse.instructor.isolation). On a machine without it, the tests
# that grade run without it and the tests of the isolation itself skip, saying why; with
# ``KVCOURSE_REQUIRE_ISOLATION=1`` (CI, .ci/run) nothing is turned off and grading fails there instead.
ISOLATION_REQUIRED = os.environ.get("KVCOURSE_REQUIRE_ISOLATION") == "1"


def isolation_missing() -> str | None:
    """Why grading cannot be isolated here (None: it can)."""
    from kvcourse.instructor import isolation

    return isolation.unavailable()


def pytest_configure(config):
    from kvcourse.instructor import isolation

    if isolation_missing() and not ISOLATION_REQUIRED:
        isolation.DEFAULT = False


def pytest_report_header(config):
    missing = isolation_missing()
    if missing:
        return [
            f"grading tests run WITHOUT isolation ({missing})"
            + ("; KVCOURSE_REQUIRE_ISOLATION=1: they fail" if ISOLATION_REQUIRED else "")
        ]
    return []


def pytest_collection_modifyitems(config, items):
    """The full native-compile sweep (minutes of ptxas) runs only when asked for: ``-m native_full``."""
    if "native_full" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="the full native-compile sweep: make test-kernels-native")
    for item in items:
        if "native_full" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_and_tok():
    torch.manual_seed(0)
    return kvcourse.load_pretrained()


@pytest.fixture(scope="session")
def model(model_and_tok):
    return model_and_tok[0]


# Tests that take ``device`` run on the CPU always and on CUDA when a GPU is present
# (``python -m kvcourse.gpu_check`` runs the cuda ones: ``-k cuda``).
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
_GPU_MODELS: dict[str, object] = {}


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture
def kernels_on(device) -> torch.device:
    """``device``, when this process's Triton kernels take tensors there: on CPU only in Triton's interpreter,
    so a process that compiles the kernels for a GPU (``make gpu-check``) skips the cpu case."""
    from kvcourse.kernels.triton_runtime import kernel_device

    if device.type != kernel_device().type:
        pytest.skip(f"kernels take {kernel_device().type} tensors in this process, not {device.type} ones")
    return device


_COPIES: dict[tuple[int, str], tuple[torch.nn.Module, torch.nn.Module]] = {}


def on_device(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module`` itself for the CPU; else a copy on ``device``, made once (a tiny test model on the GPU)."""
    if device.type == "cpu":
        return module
    key = (id(module), str(device))
    if key not in _COPIES:  # the original is kept alive beside its copy, so its id is never reused
        _COPIES[key] = (module, copy.deepcopy(module).to(device))
    return _COPIES[key][1]


def real_model_on(model, device: torch.device):
    """The real model on ``device``: the session's CPU model, or the same weights loaded once onto the GPU."""
    if device.type == "cpu":
        return model
    if str(device) not in _GPU_MODELS:
        torch.manual_seed(0)
        _GPU_MODELS[str(device)] = kvcourse.load_pretrained(device=device)[0]
    return _GPU_MODELS[str(device)]


@pytest.fixture
def model_on(model, device):
    """The real model on ``device`` (see :func:`real_model_on`)."""
    return real_model_on(model, device)


@pytest.fixture
def kernel_model(model):
    """The real model where this process's Triton kernels take their tensors: the CPU in the interpreter,
    the GPU when Triton compiles (``python -m kvcourse.gpu_check`` runs the kernel tests there)."""
    from kvcourse.kernels.triton_runtime import kernel_device

    return real_model_on(model, kernel_device())


@pytest.fixture(scope="session")
def tok(model_and_tok):
    return model_and_tok[1]


@pytest.fixture(scope="session")
def hf_model():
    """Hugging Face's LlamaForCausalLM loaded from the same GGUF: the independent reference.

    transformers is a test dependency (the ``dev`` extra): if it is missing, these tests fail, never skip.
    """
    import transformers

    path = kvcourse.gguf_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tok():
    import transformers

    path = kvcourse.gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
