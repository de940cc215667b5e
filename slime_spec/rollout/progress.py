"""The rollout's progress on the console: a live bar on a terminal, a line now and then under Ray."""

from __future__ import annotations

from tqdm import tqdm

# Where the bar cannot redraw in place (a Ray worker's stderr is a file), a progress line at most this often.
NON_TTY_PROGRESS_EVERY_S = 60.0


def progress_bar(total: int, desc: str, enabled: bool, stream) -> tqdm:
    """A live bar on a terminal. Elsewhere (under Ray) a bar would print a line per refresh: instead a line
    at most every NON_TTY_PROGRESS_EVERY_S (none for a shorter rollout), and `progress_done` prints one."""
    tty = stream.isatty()
    every = 1.0 if tty else NON_TTY_PROGRESS_EVERY_S
    return tqdm(total=total, desc=desc, disable=not enabled, file=stream, mininterval=every,
                delay=0 if tty else every)


def progress_done(bar: tqdm, desc: str, stream, elapsed_s: float) -> None:
    """Close the bar; off a terminal, the rollout's one progress line."""
    shown = not bar.disable  # tqdm's close() disables the bar
    bar.close()
    if shown and not stream.isatty():
        print(f"{desc}: {bar.n}/{bar.total} samples in {elapsed_s:.1f}s", file=stream, flush=True)
