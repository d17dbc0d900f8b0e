"""The managed llama-server's log: capped in size, rotated at a line's end, and only the
newest logs of a directory kept."""

from __future__ import annotations

import os
from pathlib import Path

from rerank_server.managed.output_log import CappedLog, prune


def test_a_log_rotates_at_a_line_end_and_keeps_one_predecessor(tmp_path: Path) -> None:
    path = tmp_path / "llama-server.log"
    log = CappedLog(path, max_bytes=100)
    for i in range(30):
        log.write(f"line {i:02d} {'.' * 20}\n".encode())  # 29 bytes each
    log.close()
    current, previous = path.read_text(), path.with_name(path.name + ".1").read_text()
    assert len(current) <= 100 and len(previous) <= 100
    assert current.endswith("line 29 " + "." * 20 + "\n")
    # Whole lines in each file, consecutive across the two: nothing cut or lost there.
    lines = previous.splitlines() + current.splitlines()
    numbers = [int(ln.split()[1]) for ln in lines]
    assert numbers == list(range(numbers[0], 30)) and all(len(ln) == 28 for ln in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".1"]


def test_a_log_continues_an_existing_file_and_counts_what_it_holds(tmp_path: Path) -> None:
    path = tmp_path / "llama-server.log"
    path.write_bytes(b"a" * 90 + b"\n")
    log = CappedLog(path, max_bytes=100)
    log.write(b"b" * 20 + b"\n")  # past the cap with what was there: rotated first
    log.close()
    assert path.read_bytes() == b"b" * 20 + b"\n"
    assert path.with_name(path.name + ".1").read_bytes() == b"a" * 90 + b"\n"


def test_a_line_is_never_split_between_two_files(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    log = CappedLog(path, max_bytes=10)
    log.write(b"12345678")  # a line begun: chunks of a pipe end anywhere
    log.write(b"abcdef")  # no line end: it goes on in this file, past the cap
    log.write(b"gh\nnext\n")  # the line ends: the file rotates after it
    log.write(b"0123456789")  # the file ends at a line's end: a new one begins before
    log.close()
    assert path.with_name("x.log.1").read_bytes() == b"next\n"
    assert path.read_bytes() == b"0123456789"


def test_prune_keeps_the_newest_logs_with_their_predecessors(tmp_path: Path) -> None:
    for i in range(12):
        for name in (f"llama-server-{i}.log", f"llama-server-{i}.log.1"):
            (tmp_path / name).write_text("x")
            os.utime(tmp_path / name, (1_000_000 + i, 1_000_000 + i))
    (tmp_path / "other.log").write_text("kept: not a llama-server log")
    removed = prune(tmp_path, "llama-server-*.log", keep=8)
    assert len(removed) == 8
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(
        ["other.log"] + [f"llama-server-{i}.log{s}" for i in range(4, 12) for s in ("", ".1")]
    )


def test_output_without_line_ends_is_cut_at_twice_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    log = CappedLog(path, max_bytes=100)
    for _ in range(1000):
        log.write(b"x" * 7)  # 7,000 bytes and not one line end
    log.close()
    sizes = [p.stat().st_size for p in (path, path.with_name("x.log.1"))]
    assert all(0 < size <= 200 for size in sizes)
