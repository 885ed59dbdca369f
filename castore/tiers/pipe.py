"""The job's end of the uploader process's pipe (the process is castore.tiers.uploader).

One process per tiered store, started at its first job and again after it
died; one JSON line per job each way (the protocol is in castore.tiers.uploader's
docstring). A process that dies mid-job fails that job, never the save: the
promotion keeps its pin and is retried.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from castore.copying import CopiedGeneration
from castore.errors import CastoreError


class UploaderPipe:
    """Jobs for the uploader process that opens the stores ``spec`` names."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.process: subprocess.Popen[str] | None = None  # None until the first job

    def run(self, job: dict[str, Any]) -> CopiedGeneration | None:
        """One job in the uploader process, started if need be: a promotion, a node's
        upload or the durable publish of a job on several nodes."""
        process = self.process
        if process is None or process.poll() is not None:
            process = self.process = subprocess.Popen(
                [sys.executable, "-m", "castore.tiers.uploader"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert process.stdin is not None
            process.stdin.write(json.dumps(self.spec) + "\n")
        what = f"{job['run']}@{job['generation']}"
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(json.dumps(job) + "\n")
            process.stdin.flush()
            line = process.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            code = process.wait()
            raise CastoreError(
                f"the uploader process died (exit status {code}) promoting {what}; "
                "the durable tier keeps its previous generation, and the promotion is retried"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise CastoreError(f"promoting {what}: {reply['error']}")
        copied = reply.get("copied")
        return None if copied is None else CopiedGeneration(**copied)

    def stop(self) -> None:
        """Close the pipe; the process ends once its job in hand is done (at most 60 s)."""
        process, self.process = self.process, None
        if process is None:
            return
        try:
            assert process.stdin is not None
            process.stdin.close()
            process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()
