"""Paragraphs of BENCHMARKS.md written by hand (hand-run A/B probes, notes on a GPU run), kept in
HAND_NOTES.json beside this file so that a new `run.py` keeps them: each note is placed after
the rendered line it names (``after``), or replaces rendered lines (``replace``, ``with``).

A note whose anchor the new page lacks (a rerun changed that line's numbers) is not dropped: it
goes under a last heading, "Hand notes to place again", to be moved by hand and its anchor
updated. `tests/test_benchmark_report.py` checks that the rendered page with its notes is
BENCHMARKS.md, so a note written into the page but not here fails there.

    uv run python benchmarks/report_hand_notes.py --from-page BENCHMARKS.md
    # after editing BENCHMARKS.md by hand: rewrites HAND_NOTES.json from the difference between
    # the rendered page and BENCHMARKS.md
"""

from __future__ import annotations

import difflib
import json
import os

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "HAND_NOTES.json")
ORPHANS = "## Hand notes to place again"


def _unique(lines: list[str], block: list[str]) -> int | None:
    """The index where `block` starts in `lines`, where it occurs exactly once."""
    n = len(block)
    found = [i for i in range(len(lines) - n + 1) if lines[i : i + n] == block]
    return found[0] if len(found) == 1 else None


def apply_hand_notes(page: str, notes: list[dict] | None = None) -> str:
    """`page` with the hand notes (default: HAND_NOTES.json's) placed; those whose anchor is not
    found exactly once are appended under `ORPHANS`."""
    if notes is None:
        if not os.path.exists(PATH):
            return page
        with open(PATH) as f:
            notes = json.load(f)
    lines, orphans = page.split("\n"), []
    for note in notes:
        anchor = note["after"] if "after" in note else note["replace"]
        at = _unique(lines, anchor)
        if at is None:
            orphans.append(note)
        elif "after" in note:
            lines[at + len(anchor) : at + len(anchor)] = note["text"]
        else:
            lines[at : at + len(anchor)] = note["with"]
    if orphans:
        lines += ["", ORPHANS, ""]
        for note in orphans:
            lines += note.get("text") or note.get("with")
            lines.append("")
    return "\n".join(lines)


def notes_between(rendered: str, page: str) -> list[dict]:
    """The notes that turn `rendered` into `page`: each insertion after the rendered line before
    it, each change as a replacement of the rendered lines."""
    a, b = rendered.split("\n"), page.split("\n")
    notes = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "insert":
            k = i1 - 1  # from the last rendered line with text before it (a blank is no anchor)
            while k > 0 and not a[k].strip():
                k -= 1
            notes.append({"after": a[max(0, k) : i1], "text": b[j1:j2]})
        elif tag in ("replace", "delete"):
            notes.append({"replace": a[i1:i2], "with": b[j1:j2]})
    return notes


def main() -> None:
    import argparse

    from report import summarize, write_markdown

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-page", required=True, help="the page edited by hand")
    args = parser.parse_args()
    results = os.path.join(os.path.dirname(os.path.dirname(PATH)), "BENCHMARKS.json")
    with open(results) as f:
        report = json.load(f)
    rendered = write_markdown(report, summarize(report), hand_notes=False)
    with open(args.from_page) as f:
        notes = notes_between(rendered, f.read())
    with open(PATH, "w") as f:
        json.dump(notes, f, indent=1)
        f.write("\n")
    print(f"{len(notes)} notes written to {PATH}")


if __name__ == "__main__":
    main()
