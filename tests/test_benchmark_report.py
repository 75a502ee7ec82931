"""BENCHMARKS.md is rendered by `benchmarks/report.py` and its `report_<subject>.py` modules from
the raw results of the last `run.py` (BENCHMARKS.json) and the records kept beside them. The
renderer must still run on those files and give every section the page has: a section that the
renderer lost (or that was added to the page by hand with no renderer) would vanish at the next
`run.py`. Only the headings are compared: the page also holds paragraphs written by hand inside
its sections (hand-run A/B probes, GPU notes), which a full `run.py` would drop; move one into
its record or its `report_*.py` module before rerunning `run.py`."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _headings(markdown: str) -> list[str]:
    return re.findall(r"^#{1,4} .*$", markdown, flags=re.M)


def test_the_renderer_gives_every_section_of_benchmarks_md(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "run.py"),
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
    assert _headings(out.read_text()) == _headings(page), (
        "BENCHMARKS.md's headings differ from what `benchmarks/run.py --render BENCHMARKS.json` "
        "writes: render the new section from its record in benchmarks/report*.py"
    )
