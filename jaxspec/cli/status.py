"""A status line on stderr while a command waits: what it is doing and for how long.

    with StatusLine() as status, engine.progress(status.phase):
      status.phase("loading the model")
      ...

On a terminal the line is redrawn every second ("compiling the speculative loop... 12 s") and
cleared when the phase ends; otherwise (a log, a pipe) each phase is one line when it ends
("[jaxspec] compiled the speculative loop in 37.4 s"), so logs stay readable.
"""

from __future__ import annotations

import sys
import threading
import time


class StatusLine:
  """Shows the current phase and its elapsed seconds on `stream` (default stderr)."""

  def __init__(self, stream=None, interval: float = 1.0):
    self.stream = sys.stderr if stream is None else stream
    self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
    self.interval = interval
    self.lock = threading.Lock()
    self.current: str | None = None
    self.started = 0.0
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def __enter__(self) -> StatusLine:
    if self.tty:
      self._thread = threading.Thread(target=self._tick, daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self.phase(None)
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=2 * self.interval)

  def phase(self, name: str | None) -> None:
    """Starts phase `name` (ending the current one), or ends the current one (None)."""
    with self.lock:
      now = time.perf_counter()
      if self.current is not None:
        secs = now - self.started
        if self.tty:
          self._write("\r\033[K")
        else:
          self._write(f"[jaxspec] {_past(self.current)} in {secs:.1f} s\n")
      self.current, self.started = name, now
      if name is not None and self.tty:
        self._write(f"\r\033[K[jaxspec] {name}... 0 s")

  def _tick(self) -> None:
    while not self._stop.wait(self.interval):
      with self.lock:
        if self.current is not None:
          self._write(f"\r\033[K[jaxspec] {self.current}... "
                      f"{time.perf_counter() - self.started:.0f} s")

  def _write(self, text: str) -> None:
    try:
      self.stream.write(text)
      self.stream.flush()
    except (OSError, ValueError):  # a closed stream: the status line is only a courtesy
      pass


def _past(phase: str) -> str:
  """'compiling the loop' -> 'compiled the loop'; 'loading x' -> 'loaded x'."""
  verb, _, rest = phase.partition(" ")
  past = {"compiling": "compiled", "loading": "loaded", "measuring": "measured"}.get(verb, verb)
  return f"{past} {rest}".strip()
