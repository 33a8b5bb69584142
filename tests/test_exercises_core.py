"""How checks and glue look in a plain notebook (Colab, JupyterLab): no bare values, short failures."""

import nbformat
import pytest
import torch
from nbclient import NotebookClient

CELLS = [
    # 0: glue outside the book build shows nothing
    "from kvcourse.utils import glue\nglue('x', '0.83')",
    # 1: a right answer: the check says so in words, and no `Out: True` follows
    "import torch\nfrom kvcourse.exercises import ch01\n"
    "def causal_mask(t, s):\n    return torch.ones(t, s, dtype=torch.bool).tril(s - t)\n"
    "ch01.check_causal_mask(causal_mask)",
    # 2: an unwritten stub: "Not done yet" and the hint, no error, so "Run all" goes on
    "def causal_mask(t, s):\n    raise NotImplementedError('build the lower triangle')\nch01.check_causal_mask(causal_mask)",
    # 3: a crash in the learner's code: its own frame is shown, the check's are not
    "def causal_mask(t, s):\n    return [][0]\nch01.check_causal_mask(causal_mask)",
    # 4: a wrong answer: the check's message alone
    "def causal_mask(t, s):\n    return torch.ones(t, s, dtype=torch.bool)\nch01.check_causal_mask(causal_mask)",
]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in CELLS])
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True).execute()
    return nb.cells


def test_glue_and_a_passing_check_echo_no_bare_value(executed):
    for cell in executed[:2]:
        assert [o for o in cell.outputs if o.output_type == "execute_result"] == []
    assert executed[1].outputs[0].text.startswith("Correct:")


def test_an_unwritten_stub_is_reported_not_raised(executed):
    outputs = executed[2].outputs
    assert [o.output_type for o in outputs] == ["stream"], outputs  # no error, no Out: a "Run all" goes on
    assert outputs[0].text.startswith("Not done yet:") and "build the lower triangle" in outputs[0].text


def test_a_wrong_answer_shows_one_message(executed):
    (error,) = [o for o in executed[4].outputs if o.output_type == "error"]
    assert error.ename == "ExerciseError" and len(error.traceback) == 1 and "_core.py" not in error.traceback[0]


def test_a_crash_in_the_learners_code_shows_the_learners_frame_only(executed):
    (error,) = [o for o in executed[3].outputs if o.output_type == "error"]
    text = "\n".join(error.traceback)
    assert "return [][0]" in text and "IndexError" in text
    assert "_core.py" not in text and "exercises/ch01.py" not in text


def test_checks_hand_the_learner_tensors_on_the_chapters_device():
    from kvcourse.exercises._core import learner_device
    from kvcourse.utils import default_device

    assert learner_device() == default_device()  # the GPU on Colab, where the chapters now run
    assert learner_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be"):
        learner_device("no-such-device")


def test_a_device_mismatch_in_the_learners_code_gets_the_device_hint():
    from kvcourse.exercises._core import DEVICE_HINT, ExerciseError, call_learner

    def made_on_the_cpu(x):  # what the first GPU run of chapter 5 raised
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
        )

    def plain_bug(x):
        raise RuntimeError("shape '[2, 3]' is invalid for input of size 5")

    with pytest.raises(ExerciseError) as err:
        call_learner("attend", made_on_the_cpu, torch.zeros(2))
    assert DEVICE_HINT in str(err.value) and "device=x.device" in str(err.value)
    with pytest.raises(ExerciseError) as err:
        call_learner("attend", plain_bug, torch.zeros(2))
    assert DEVICE_HINT not in str(err.value)
