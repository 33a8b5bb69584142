"""kvcourse.utils: the device helpers every chapter uses (default_device, synchronize, describe_device)."""

from __future__ import annotations

import platform

import pytest
import torch

from kvcourse.utils import default_device, describe_device, synchronize


def test_default_device_is_the_gpu_when_there_is_one():
    assert default_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_synchronize_waits_for_queued_work(device):
    x = torch.randn(256, 256, device=device, generator=None)
    y = x @ x  # queued on a GPU
    synchronize(device)
    synchronize(str(device))  # a name works as well as a torch.device
    if device.type == "cuda":
        assert torch.cuda.current_stream(device).query()  # nothing left queued
    assert y.shape == (256, 256)


def test_describe_device_names_what_timed(device):
    text = describe_device(device)
    if device.type == "cuda":
        assert text == torch.cuda.get_device_name(device)
    else:  # chapter 1's committed output prints exactly this for the CPU it ran on
        assert text == f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"


def test_bad_device_names_are_refused():
    with pytest.raises(RuntimeError):
        synchronize("no-such-device")


def test_quoted_source_is_shown_without_tool_pragmas():
    """show_source quotes the package for a reader: `# fmt: skip` and `# noqa` are for the project's tools
    (issue 48: chapters 5 and 6 showed `# fmt: skip` ten times)."""
    from kvcourse.utils import show_source, strip_pragmas

    src = 'x = {1: 2}  # fmt: skip\nf = lambda: 0  # noqa: E731\ny = "# not a pragma"  # why: a real comment\n'
    assert strip_pragmas(src) == 'x = {1: 2}\nf = lambda: 0\ny = "# not a pragma"  # why: a real comment\n'
    from kvcourse.control.playground import Playground

    shown = show_source(Playground.__init__).data
    assert "fmt: skip" not in shown and "self.scheduler = Scheduler(" in shown
    with pytest.raises(TypeError, match="source"):
        strip_pragmas(None)
