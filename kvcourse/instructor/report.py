"""Feedback from a grading run: one page per student, one summary and one plot for the class.

* ``STUDENT.md`` and ``STUDENT.html``: every exercise of every notebook the student handed in, passed
  or not, and for a failed one what the check expected, what came back and its hint (or what the
  solution raised); then notes from running the notebook top to bottom.
* ``summary.md``: the pass rate of every exercise and the score of every student.
* ``pass_rates.png``: the pass rates as bars, lowest first: what the class struggled with.

A student is a submission folder (``alice/`` in ``submissions/alice/01_naive_generation.ipynb``); a
flat folder of notebooks is one submission, reported as its folder's name.
"""

from __future__ import annotations

import html
from collections import defaultdict
from pathlib import Path

from .grade import NotebookResult, Row

__all__ = ["student_of", "write_student_reports", "write_class_summary"]


def student_of(notebook: str, flat_name: str = "submission") -> str:
    """The student a notebook path (relative to the submissions folder) belongs to."""
    parts = notebook.split("/")
    return parts[0] if len(parts) > 1 else flat_name


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def _feedback(row: Row) -> list[tuple[str, str]]:
    """(label, text) pairs that explain a row: case / expected / got / hint when the check gave them."""
    if row.passed:
        return []
    if row.hint or row.expected or row.got:
        parts = [("Case", row.case), ("Expected", row.expected), ("Got", row.got), ("Hint", row.hint)]
        return [(k, v.strip()) for k, v in parts if v.strip()]
    return [("Problem", row.message)]


def _student_markdown(student: str, results: list[NotebookResult]) -> str:
    rows = [r for res in results for r in res.rows]
    lines = [f"# Feedback for {student}", "", f"{sum(r.passed for r in rows)} of {len(rows)} exercises passed.", ""]
    for res in results:
        lines += [f"## {res.notebook}", "", "| Exercise | Passed | Feedback |", "| --- | --- | --- |"]
        for row in res.rows:
            text = "<br>".join(f"**{k}:** {_cell(v)}" for k, v in _feedback(row))
            lines.append(f"| `{row.exercise}` | {'yes' if row.passed else 'no'} | {text} |")
        if res.notes:
            lines += ["", "Notes (from running the notebook top to bottom, and from grading):", ""] + [
                f"- {n}" for n in res.notes
            ]
        lines.append("")
    return "\n".join(lines)


def _student_html(student: str, results: list[NotebookResult]) -> str:
    rows = [r for res in results for r in res.rows]
    body = [
        f"<h1>Feedback for {html.escape(student)}</h1>",
        f"<p>{sum(r.passed for r in rows)} of {len(rows)} exercises passed.</p>",
    ]
    for res in results:
        body.append(
            f"<h2>{html.escape(res.notebook)}</h2><table><tr><th>Exercise</th><th>Passed</th><th>Feedback</th></tr>"
        )
        for row in res.rows:
            text = "".join(f"<p><b>{k}:</b> <pre>{html.escape(v)}</pre></p>" for k, v in _feedback(row))
            mark = "yes" if row.passed else "no"
            body.append(
                f"<tr class='{mark}'><td><code>{html.escape(row.exercise)}</code></td><td>{mark}</td>"
                f"<td>{text}</td></tr>"
            )
        body.append("</table>")
        if res.notes:
            body.append(
                "<p>Notes (from running the notebook top to bottom, and from grading):</p><ul>"
                + "".join(f"<li>{html.escape(n)}</li>" for n in res.notes)
                + "</ul>"
            )
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse;width:100%}"
        "td,th{border:1px solid #ccc;padding:.3em;vertical-align:top;text-align:left}"
        "tr.yes td:nth-child(2){color:#176f2c}tr.no td:nth-child(2){color:#b3261e}"
        "pre{white-space:pre-wrap;margin:0}"
    )
    return (
        f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>Feedback for "
        f"{html.escape(student)}</title><style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _by_student(results: list[NotebookResult], flat_name: str) -> dict[str, list[NotebookResult]]:
    grouped: dict[str, list[NotebookResult]] = defaultdict(list)
    for res in results:
        grouped[student_of(res.notebook, flat_name)].append(res)
    return dict(grouped)


def write_student_reports(results: list[NotebookResult], out: Path, flat_name: str = "submission") -> list[Path]:
    """One ``.md`` and one ``.html`` page per student in ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for student, theirs in sorted(_by_student(results, flat_name).items()):
        for suffix, text in ((".md", _student_markdown(student, theirs)), (".html", _student_html(student, theirs))):
            path = out / f"{student}{suffix}"
            path.write_text(text, encoding="utf-8")
            written.append(path)
    return written


def _rates(results: list[NotebookResult]) -> list[tuple[str, int, int]]:
    """(exercise, passed, graded) in the order the exercises first appear."""
    counts: dict[str, list[int]] = {}
    for res in results:
        for row in res.rows:
            passed, total = counts.setdefault(row.exercise, [0, 0])
            counts[row.exercise] = [passed + row.passed, total + 1]
    return [(label, p, n) for label, (p, n) in counts.items()]


def write_class_summary(results: list[NotebookResult], out: Path, flat_name: str = "submission") -> tuple[Path, Path]:
    """``summary.md`` and ``pass_rates.png`` in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    rates = _rates(results)
    students = _by_student(results, flat_name)
    lines = [
        "# Class summary",
        "",
        f"{len(students)} students, {sum(len(r.rows) for r in results)} graded exercises.",
        "",
        "## Pass rate per exercise",
        "",
        "| Exercise | Passed | Graded | Rate |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| `{label}` | {p} | {n} | {100 * p / n:.0f}% |" for label, p, n in rates]
    lines += [
        "",
        "![Pass rate per exercise](pass_rates.png)",
        "",
        "## Per student",
        "",
        "| Student | Passed | Exercises | Notebooks run (s) | Checks (s) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for student, theirs in sorted(students.items()):
        rows = [r for res in theirs for r in res.rows]
        run, checks = sum(res.run_seconds for res in theirs), sum(r.seconds for r in rows)
        lines.append(f"| {_cell(student)} | {sum(r.passed for r in rows)} | {len(rows)} | {run:.0f} | {checks:.0f} |")
    summary = out / "summary.md"
    summary.write_text("\n".join(lines) + "\n", encoding="utf-8")

    order = sorted(rates, key=lambda r: (r[1] / r[2], r[0]))
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(order) + 1.6))
    values = [100 * p / n for _, p, n in order]
    ax.barh([label for label, _, _ in order], values, color="#4c72b0")
    for y, ((_, p, n), value) in enumerate(zip(order, values)):
        ax.text(min(value + 1, 88), y, f"{p}/{n}", va="center", fontsize=8)
    ax.invert_yaxis()  # the lowest rate on top
    ax.set_xlim(0, 100)
    ax.set_xlabel("students who passed (%)")
    ax.set_ylabel("exercise")
    if order:
        worst = order[0]
        ax.set_title(f"Pass rate per exercise: lowest is {worst[0]} ({100 * worst[1] / worst[2]:.0f}%)")
    fig.tight_layout()
    plot = out / "pass_rates.png"
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    return summary, plot
