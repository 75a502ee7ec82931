"""Where a thread's time went, in order: its stack sampled every few milliseconds, runs of the
same stack folded into one line, and the steady state (a frame named to `collapse`, such as the
training loop's) folded into one line per stretch. `lm.py --stacks` takes one of the flow's
training thread (the trainer's own, `prefect-jax-trainer`, found by name once it exists), to say
what each part of a save's stretch and of the job's end costs where no profiler is installed (a
lent GPU machine).

    timeline = StackTimeline("prefect-jax-trainer").start()  # or a thread's ident
    ...
    timeline.stop(); open("stacks.txt", "w").write(timeline.text())
"""

from __future__ import annotations

import os
import sys
import threading
import time


class StackTimeline:
    def __init__(
        self, thread: int | str, every: float = 0.02, collapse=(("training/loop.py", "run"),)
    ):
        # (a name: the thread may start after the timeline does, so it is looked up as sampled)
        self.thread, self.every, self.collapse = thread, every, collapse
        self.rows: list[list] = []  # [first seen s, last seen s, stack]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="stack-timeline", daemon=True)

    def start(self) -> StackTimeline:
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _key(self, frame) -> str:
        names = []
        while frame is not None:
            code = frame.f_code
            for path, name in self.collapse:
                if code.co_name == name and code.co_filename.endswith(path):
                    return f"[{path} {name}: the steady state]"
            names.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
            frame = frame.f_back
        return " < ".join(names[:10])

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            frame = sys._current_frames().get(self._thread_id())
            if frame is None:
                continue
            key, now = self._key(frame), time.perf_counter() - self.t0
            if self.rows and self.rows[-1][2] == key:
                self.rows[-1][1] = now
            else:
                self.rows.append([now, now, key])

    def _thread_id(self) -> int | None:
        if isinstance(self.thread, int):
            return self.thread
        return next((t.ident for t in threading.enumerate() if t.name == self.thread), None)

    def text(self, min_s: float = 0.0) -> str:
        """One line a run: its start and end (s from `start`), then its stack, innermost first;
        runs shorter than `min_s` left out."""
        return "".join(f"{a:8.2f} {b:8.2f}  {key}\n" for a, b, key in self.rows if b - a >= min_s)
