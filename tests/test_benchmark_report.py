"""BENCHMARKS.md is rendered by `benchmarks/report.py` and its `report_<subject>.py` modules from
the raw results of the last `run.py` (BENCHMARKS.json), the records kept beside them and the
paragraphs written by hand (benchmarks/HAND_NOTES.json, placed by `report_hand_notes`). The
rendering must be the page itself: a section the renderer lost, or a paragraph written into the
page and not into HAND_NOTES.json, would vanish at the next `run.py`."""

import difflib
import os
import subprocess
import sys

from process_helpers import BENCHMARKS_DIR

ROOT = os.path.dirname(BENCHMARKS_DIR)


def test_the_rendered_page_is_benchmarks_md(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    subprocess.run(
        [
            sys.executable,
            os.path.join(BENCHMARKS_DIR, "run.py"),
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
    sys.path.insert(0, BENCHMARKS_DIR)
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


def test_goodput_verdicts_give_each_rounds_difference_and_count_a_run_that_never_finished():
    sys.path.insert(0, BENCHMARKS_DIR)
    from goodput import _turn
    from report_goodput import _goodput_verdicts

    def run(system, total, repeat, failed=False):
        r = {"system": system, "period_s": 30.0, "signal": "KILL", "total_s": total}
        return {**r, "repeat": repeat, **({"failed": "torn backup"} if failed else {})}

    reference = {"prefect_jax": 100.0, "plain": 100.0}
    one_round = [run("prefect_jax", 100.0, 0), run("plain", 125.0, 0)]
    assert _goodput_verdicts(one_round, reference) == "T=30 SIGKILL vs plain: +0.200"
    rounds = [*one_round, run("prefect_jax", 125.0, 1), run("plain", 100.0, 1, failed=True)]
    # means 0.9 and 0.4 (a run that never finished scores 0), each round's difference after
    assert _goodput_verdicts(rounds, reference) == (
        "T=30 SIGKILL vs plain: +0.500 (rounds: +0.200, +0.800)"
    )
    behind = [run("prefect_jax", 125.0, 0), run("plain", 100.0, 0)]
    assert _goodput_verdicts(behind, reference).endswith("-0.200 (**below**)")
    # each cell starts with the next system, so that none always runs first
    systems = ["prefect_jax", "plain", "keras"]
    assert [_turn(systems, k)[0] for k in range(4)] == [
        "prefect_jax",
        "plain",
        "keras",
        "prefect_jax",
    ]


def test_a_save_mid_run_is_read_against_the_loop_without_saves_to_the_last_step():
    sys.path.insert(0, BENCHMARKS_DIR)
    from report_scale import mid_run_stall

    # Stretches of 10 steps, from steps 10, 20, ..., 70; the side's stretches that start at a
    # save (steps 20, 40, 60) take 0.3 s more, and one after a save (step 30) 0.1 s more: what a
    # save costs the stretch after it counts too.
    floor_s = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]
    side_s = [1.0, 1.4, 1.3, 1.6, 1.4, 1.8, 1.6]

    def marks(stretches):
        out, t = [(10, 0.0)], 0.0
        for i, s in enumerate(stretches):
            t += s
            out.append((20 + 10 * i, t))
        return out

    # 1.0 s over the three saves before the last mark (80: the job's end, not mid-run)
    lost = mid_run_stall({"marks": marks(side_s)}, {"marks": marks(floor_s)}, every=20)
    assert abs(lost - 1.0 / 3) < 1e-9
    # marks at other steps than the floor's do not pair
    assert mid_run_stall({"marks": marks(side_s)[:-1]}, {"marks": marks(floor_s)}, 20) is None
