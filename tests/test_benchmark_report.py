"""BENCHMARKS.md is rendered by `benchmarks/report.py` and its `report_<subject>.py` modules from
the raw results of the last `run.py` (BENCHMARKS.json), the records kept beside them and the
paragraphs written by hand (benchmarks/HAND_NOTES.json, placed by `report_hand_notes`). The
rendering must be the page itself: a section the renderer lost, or a paragraph written into the
page and not into HAND_NOTES.json, would vanish at the next `run.py`."""

import difflib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def test_the_rendered_page_is_benchmarks_md(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    subprocess.run(
        [
            sys.executable,
            os.path.join(BENCHMARKS, "run.py"),
            "--render",
            os.path.join(ROOT, "BENCHMARKS.json"),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    with open(os.path.join(ROOT, "BENCHMARKS.md")) as f:
        page = f.read()
    rendered = out.read_text()
    diff = list(difflib.unified_diff(rendered.split("\n"), page.split("\n"), lineterm="", n=0))
    assert rendered == page, (
        "BENCHMARKS.md differs from `benchmarks/run.py --render BENCHMARKS.json` (rendered -> "
        "page below): render a new section from its record in benchmarks/report*.py, or keep a "
        "hand-written paragraph with `python benchmarks/report_hand_notes.py --from-page "
        "BENCHMARKS.md`\n" + "\n".join(line[:160] for line in diff[:20])
    )


def test_a_hand_note_whose_line_is_gone_is_kept_at_the_end():
    sys.path.insert(0, BENCHMARKS)
    from report_hand_notes import ORPHANS, apply_hand_notes, notes_between

    rendered = "# B\n\nrow 1.0\n\n## S\n\nx = 2\n"
    page = "# B\n\nrow 1.0\n\nmy probe\n\n## S\n\nx = 2 (by hand)\n"
    notes = notes_between(rendered, page)
    assert apply_hand_notes(rendered, notes) == page
    # a rerun changed the lines the notes follow or replace: nothing is dropped
    again = apply_hand_notes("# B\n\nrow 1.1\n\n## S\n\nx = 3\n", notes)
    assert again.split(ORPHANS)[1].split("\n") == [
        "",
        "",
        "my probe",
        "",
        "",
        "x = 2 (by hand)",
        "",
    ]
