"""Processes below a pid, read from Linux /proc: for tests that kill a peer's helper processes."""

from __future__ import annotations

from pathlib import Path


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid`, with its command name."""
    out: dict[int, str] = {}
    todo = children_of(pid)
    while todo:
        child = todo.pop()
        try:
            out[child] = (Path("/proc") / str(child) / "comm").read_text().strip()
        except OSError:
            continue
        todo.extend(children_of(child))
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may not reap orphans)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
