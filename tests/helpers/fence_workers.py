"""One writer process for the fencing tests: it opens a store and obeys commands.

Run as ``python fence_workers.py ADDRESS OPTIONS_JSON [SOCKET]``; each line of
stdin (or of the Unix socket it connects to) is a JSON command, and each
answer is one JSON line on stdout (or the socket):

* ``{"op": "save", "step": N, "mode": M}``: save a small state of run ``r`` at
  step N through ``M``: ``store`` (Store.save), ``async`` (Store.save with
  blocking=False, then result()), ``dist`` (castore.dist.save in a gloo group
  of one), ``train`` (TrainState.save at update N) or ``dcp`` (DCP's save with
  castore's StorageWriter). Answers ``{"ok": true, "generation": ID}`` or the
  error's type and message, with every warning raised.
* ``{"op": "load"}``: load the latest generation (``"generation": ID``: that one);
  answers its step.
* ``{"op": "claim"}``: Store.claim_run("r").
* ``{"op": "amend", "to": KEY}``: castore.amend of the latest generation, key "w"
  renamed KEY.
* ``{"op": "hold", "step": N}``: start a Store.save at step N on a thread and
  answer once it has read the run's ref and reached its compare-and-swap, which
  waits there; ``{"op": "release"}`` lets it go on and answers as a save does.
* ``{"op": "quit"}``.

A real process each, so that two of them are two writers of the run exactly as
two jobs are: each has its own pid, and what a process knows of the run
(castore.core.fencing) is its own.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import threading
import warnings
from typing import Any

import numpy as np

import castore

RUN = "r"


def state(step: int) -> dict[str, Any]:
    return {"w": np.full(64, step, dtype=np.float32), "step": step}


def ensure_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        handle, name = tempfile.mkstemp(prefix="fence-pg-")
        os.close(handle)
        os.unlink(name)
        dist.init_process_group("gloo", init_method=f"file://{name}", rank=0, world_size=1)


def save(store: castore.Store, step: int, mode: str) -> Any:
    if mode == "store":
        return store.save(state(step), run=RUN, step=step)
    if mode == "async":
        return store.save(state(step), run=RUN, step=step, blocking=False).result()
    import torch

    ensure_group()
    if mode == "dist":
        import castore.dist

        return castore.dist.save(store, state(step), run=RUN, step=step, timeout=30)
    if mode == "train":
        from castore.train import TrainState

        model = torch.nn.Linear(4, 2)
        train = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        train.update = step
        return train.save(store, run=RUN, timeout=30)
    if mode == "dcp":
        import torch.distributed.checkpoint as dcp

        from castore.dcp import CastoreWriter

        writer = CastoreWriter(store, run=RUN, step=step)
        dcp.save({"w": torch.full((64,), float(step))}, storage_writer=writer)
        return writer.generation
    raise ValueError(f"unknown mode {mode!r}")


class Held:
    """One save held at its compare-and-swap: the ref read, the advance not yet made."""

    def __init__(self) -> None:
        self.reached, self.go = threading.Event(), threading.Event()
        self.outcome: list[Any] = []

    def start(self, store: castore.Store, step: int) -> None:
        advance = store.refs.advance

        def held_advance(*args: Any, **kwargs: Any) -> Any:
            self.reached.set()
            self.go.wait(60)
            return advance(*args, **kwargs)

        store.refs.advance = held_advance  # type: ignore[method-assign]

        def run() -> None:
            try:
                self.outcome.append(store.save(state(step), run=RUN, step=step))
            except Exception as exc:  # noqa: BLE001 - answered by finish()
                self.outcome.append(exc)
            finally:
                store.refs.advance = advance  # type: ignore[method-assign]

        self.thread = threading.Thread(target=run)
        self.thread.start()
        if not self.reached.wait(60):
            raise TimeoutError("the held save never reached its compare-and-swap")

    def finish(self) -> Any:
        self.go.set()
        self.thread.join(60)
        (outcome,) = self.outcome
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


HELD = Held()


def obey(store: castore.Store, command: dict[str, Any]) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if command["op"] == "save":
                generation = save(store, command["step"], command.get("mode", "store"))
                answer: dict[str, Any] = {"ok": True, "generation": generation.id}
            elif command["op"] == "load":
                loaded = store.load(RUN, command.get("generation", "latest"))
                answer = {"ok": True, "step": int(loaded["step"])}
            elif command["op"] == "hold":
                HELD.start(store, command["step"])
                answer = {"ok": True}
            elif command["op"] == "release":
                generation = HELD.finish()
                answer = {"ok": True, "generation": generation.id}
            elif command["op"] == "claim":
                store.claim_run(RUN)
                answer = {"ok": True}
            elif command["op"] == "amend":  # the latest, its "w" renamed
                generation = castore.amend(store, RUN, rename=[("w", command["to"])])
                answer = {"ok": True, "generation": generation.id}
            else:
                raise ValueError(f"unknown op {command['op']!r}")
        except (Exception, BaseException) as exc:  # noqa: BLE001 - DCP's CheckpointException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            answer = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
    answer["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    answer["pid"] = os.getpid()
    return answer


def main() -> None:
    address, options = sys.argv[1], json.loads(sys.argv[2])
    commands, answers = sys.stdin, sys.stdout
    if len(sys.argv) > 3:  # forked from the zygote: no pipes, a Unix socket instead
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(sys.argv[3])
        commands, answers = connection.makefile("r"), connection.makefile("w")
    store = castore.open(address, **options)
    print(json.dumps({"ready": os.getpid()}), file=answers, flush=True)
    for line in commands:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        print(json.dumps(obey(store, command)), file=answers, flush=True)
    store.close()


if __name__ == "__main__":
    main()
