"""A peer engine (llama.cpp) run in a child process, so that a crash inside it cannot take the bench down.

A native library can die on its own (llama.cpp's AMX backend segfaults on some Xeons): in the bench's process that
kills every method's results. `PeerProcess` builds the engine in a spawned child and forwards `prefill` / `decode`
to it over a pipe; the child times its own calls, so the pipe is not timed. When the child dies, every later call
raises `PeerCrashed`, whose message says how (the signal or the exit code), and the bench reports it in its table.
A Python exception inside the child is not a crash: it is raised in the bench's process as a `RuntimeError` carrying
the child's traceback.
"""

from __future__ import annotations

import multiprocessing
import signal
import traceback

import torch


class PeerCrashed(RuntimeError):
    """The peer engine's process died (a signal or an exit without an answer)."""


def _serve(connection, engine_class, kwargs: dict) -> None:
    """The child's loop: build the engine, then answer ``(name, args)`` requests until ``("close", ())``."""
    try:
        engine = engine_class(**kwargs)
        connection.send(("ok", None))
    except Exception:  # the parent raises it with this traceback
        connection.send(("error", traceback.format_exc()))
        return
    while True:
        name, args = connection.recv()
        if name == "close":
            return
        try:
            if name == "prefill":
                answer = engine.prefill(torch.tensor(args[0]))
            else:  # decode: ids, new_tokens, sampling, seed
                seconds, sequences = engine.decode(torch.tensor(args[0]), *args[1:])
                answer = seconds, sequences.tolist()
            connection.send(("ok", answer))
        except Exception:
            connection.send(("error", traceback.format_exc()))


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class PeerProcess:
    """``engine_class(**kwargs)`` in a spawned child process, with the engine's ``prefill(ids)`` and ``decode(ids,
    new_tokens, sampling, seed)`` (``ids``: [1, prompt] token ids). ``label`` names it in `PeerCrashed`. Picklable
    ``engine_class`` and ``kwargs`` (spawn: the child imports the class by name). The engine is built in the child
    while the caller goes on; a failure to build it is raised by the first call."""

    def __init__(self, label: str, engine_class, kwargs: dict) -> None:
        self.label = label
        self.prefill_seconds = float("nan")
        self.crashed: str | None = None
        self._built = False
        self._calls = 0
        context = multiprocessing.get_context("spawn")  # a fork would copy torch's OpenMP state into the child
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, engine_class, kwargs), daemon=True)
        self._process.start()
        child.close()

    def _died(self, during: str) -> PeerCrashed:
        self._process.join(timeout=10)
        self.crashed = f"{self.label} {_how_it_ended(self._process.exitcode)} during {during}"
        return PeerCrashed(self.crashed)

    def _answer(self, during: str):
        try:
            status, value = self._connection.recv()
        except (EOFError, ConnectionError):
            raise self._died(during) from None
        if status == "error":
            raise RuntimeError(f"{self.label} failed in its process during {during}:\n{value}")
        return value

    def _call(self, name: str, *args):
        if self.crashed is not None:
            raise PeerCrashed(self.crashed)
        if not self._built:
            self._answer("its start")
            self._built = True
        self._calls += 1
        during = f"call {self._calls} ({name})"
        try:
            self._connection.send((name, args))
        except (BrokenPipeError, ConnectionError):
            raise self._died(during) from None
        return self._answer(during)

    def prefill(self, ids: torch.Tensor) -> float:
        """The engine's prefill of ``ids`` [1, prompt] (its seconds, also kept in ``prefill_seconds``)."""
        self.prefill_seconds = self._call("prefill", ids.tolist())
        return self.prefill_seconds

    def decode(self, ids: torch.Tensor, new_tokens: int, sampling: dict | None, seed: int
               ) -> tuple[float, torch.Tensor]:
        """``(seconds, sequences)`` of one run of the engine (its own clock): sequences [1, prompt + new]."""
        seconds, sequences = self._call("decode", ids.tolist(), new_tokens, sampling, seed)
        return seconds, ids.new_tensor(sequences)

    def close(self) -> None:
        """Ends the child (a crashed one is gone already)."""
        if self.crashed is None and self._process.is_alive():
            try:
                self._connection.send(("close", ()))
            except (BrokenPipeError, ConnectionError):
                pass  # it died between the check and the send: nothing left to end
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._connection.close()
