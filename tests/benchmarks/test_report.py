"""The shared report module: a benchmark's output sent to a file has plain lines, a terminal gets bars."""

from __future__ import annotations

import fcntl
import io
import os
import struct
import termios

from benchmarks.report import row_progress


def test_output_to_a_file_is_one_plain_line_per_finished_row(tmp_path) -> None:
    with open(tmp_path / "log.txt", "w") as stream:
        rows = row_progress(["fastpersist", "dataflux"], [2, 3], stream=stream)
        for _ in range(2):
            rows[0].update()
        rows[1].update()  # unfinished: says nothing
        for row in rows:
            row.close()
    text = (tmp_path / "log.txt").read_text()
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastpersist: 2 ops in ")
    assert "\x1b" not in text and "\r" not in text


def _drain(leader: int) -> bytes:
    """Everything written to the pty: one read returns only what the kernel had buffered by then."""
    chunks = []
    try:
        while chunk := os.read(leader, 65536):
            chunks.append(chunk)
    except OSError:  # EIO: the follower is closed and the buffer is empty
        pass
    finally:
        os.close(leader)
    return b"".join(chunks)


def test_a_terminal_gets_progress_bars() -> None:
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with open(follower, "w") as terminal:
        rows = row_progress(["fastpersist"], [2], stream=terminal)
        rows[0].update()
        rows[0].update()
        rows[0].close()
        terminal.flush()
    shown = _drain(leader).decode(errors="replace")
    assert "2/2" in shown and "\r" in shown


def test_a_pipe_is_not_a_terminal() -> None:
    stream = io.StringIO()
    row = row_progress(["raw"], [1], stream=stream)[0]
    row.update()
    row.close()
    assert stream.getvalue().startswith("raw: 1 ops in ")
