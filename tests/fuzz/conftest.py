"""The fuzz suite's report: examples run per op and back end (the figures of docs/error-policy.md), shown
at the end of a run in one process (``-n 0``; pytest-xdist workers keep their own counts)."""

from fuzzkit import EXAMPLES_RUN, FULL


def pytest_terminal_summary(terminalreporter):
    if not EXAMPLES_RUN:
        return
    terminalreporter.section(f"fuzz examples run ({'full size' if FULL else 'CI size'})")
    for name, count in sorted(EXAMPLES_RUN.items()):
        terminalreporter.write_line(f"{name:48s} {count:7d}")
    terminalreporter.write_line(f"{'total':48s} {sum(EXAMPLES_RUN.values()):7d}")
