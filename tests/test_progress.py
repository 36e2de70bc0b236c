"""Progress lines for output that is not a terminal (cluster logs)."""

from __future__ import annotations

import io

from boosttune.core.progress import LineProgress, progress


def test_a_file_gets_plain_lines_with_the_bars_figures() -> None:
    out = io.StringIO()
    bar = progress(total=4, desc="teacher", unit="prompt", file=out)
    assert isinstance(bar, LineProgress)
    bar.interval = 0.0  # a line at every update
    bar.set_postfix(tok=12)
    bar.update(1)
    bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("[boosttune] teacher: 1/4 prompt (25%), ") and "ETA" in lines[0] and "tok=12" in lines[0]
    assert lines[1].startswith("[boosttune] teacher: 2/4 prompt (50%), ") and "ETA" in lines[1]
    assert lines[-1].startswith("[boosttune] teacher: done, elapsed ")  # 2/4 was just written: not again


def test_lines_come_at_the_interval_not_at_every_update() -> None:
    out = io.StringIO()
    for _ in LineProgress(range(1000), desc="grow", unit="batch", interval=3600, file=out):
        pass
    assert len(out.getvalue().splitlines()) == 1  # only the closing line
    assert "1000/1000 batch (100%)" in out.getvalue() and "(done)" in out.getvalue()


def test_the_final_count_is_written_once() -> None:
    """The update that reaches a known total writes no line of its own (the closing line gives the count);
    with no total, the closing line does not repeat a count just written."""
    for total, final, closing in ((3, ": 3/3 prompt (100%)", "(done)"), (None, ": 3 prompt,", "teacher: done, elapsed")):
        out = io.StringIO()
        bar = LineProgress(total=total, desc="teacher", unit="prompt", interval=0.0, file=out)
        for _ in range(3):
            bar.update(1)
        bar.close()
        bar.close()
        lines = out.getvalue().splitlines()
        assert len([x for x in lines if final in x]) == 1 and closing in lines[-1], lines


def test_iterating_writes_the_final_count_once() -> None:
    out = io.StringIO()
    for _ in LineProgress(range(5), desc="grow", unit="batch", interval=0.0, file=out):
        pass
    lines = out.getvalue().splitlines()
    assert [x for x in lines if "5/5" in x] == [lines[-1]] and lines[-1].endswith("(done)"), lines
