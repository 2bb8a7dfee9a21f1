"""A done document's original, kept, moved or deleted by policy, but only while it still holds the content that was
processed: a file saved again meanwhile is new content, queued as a job of its own."""

from __future__ import annotations

import logging
from pathlib import Path

from .errors import Failure
from .files import CHANGED, KEEP, Folders, Version, identify, settle_original
from .queue.store import Job, Queue

log = logging.getLogger(__name__)


class Originals:
    def __init__(self, queue: Queue, folders: Folders, policy: str, max_bytes: int) -> None:
        """`policy`: one of files.ORIGINALS; `max_bytes`: the largest file read to check its content."""
        self.queue = queue
        self.folders = folders
        self.policy = policy
        self.max_bytes = max_bytes

    def settle(self, job: Job, source: Path, identity: Version | None = None) -> None:
        """Keep, move or delete the original of the done `job` by policy, if `source` still holds its content:
        only the very file that was read (`identity`; None when it was not read just now, so it is read here)."""
        if self.policy == KEEP:
            return
        if identity is None:
            identity = self._identify_as(job, source)
            if identity is None:
                return
        if settle_original(source, self.policy, self.folders, identity) == CHANGED:
            log.info("job %d: %s changed after it was read; not %s", job.id, source, self.policy)
            self._identify_as(job, source)

    def requeue_changed(self, job: Job, sha256: str) -> None:
        """The file was rewritten after it was queued: its new content is a new job, and this one ends."""
        new, created = self.queue.add(
            job.path,
            sha256,
            model_key=job.model_key,
            settings_key=job.settings_key,
            priority=job.priority,
            max_attempts=job.max_attempts,
            batch_window=job.batch_window,
            pinned=True,  # the content was read here: on a shared queue it is this machine's file, whatever the path
        )
        which = f"queued as job #{new.id}" if created else f"already job #{new.id} ({new.state})"
        raise Failure("changed", f"the file changed after it was queued; its new content is {which}", set_aside=False)

    def _identify_as(self, job: Job, source: Path) -> Version | None:
        """The identity of `source` if it still holds the content of `job`; otherwise its new content is queued
        (`requeue_changed`) and None returned, and so is None for a file that can no longer be read."""
        try:
            sha256, identity = identify(source, self.max_bytes)
        except (OSError, ValueError) as e:
            log.info("job %d: %s not settled: %s", job.id, source, e)
            return None
        if sha256 == job.sha256:
            return identity
        try:
            self.requeue_changed(job, sha256)
        except Failure as changed:
            log.info("job %d: %s", job.id, changed)
        return None
