"""Model downloads from the Hugging Face hub (or a mirror): search, info, download, cancel, retry.

A download runs `omlx.admin.hf_fetch` (huggingface_hub's `snapshot_download`) in a child
process, into `$model_dir/.downloads/<org>--<name>` (hidden from discovery), and moves the
finished folder to `$model_dir/<org>/<name>`. Progress is the bytes on disk against the
sizes the hub lists (huggingface_hub writes in 10 MB pieces). Cancelling kills the child;
finished files stay, so a retry fetches only the files still missing.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import Field, SkipValidation

from omlx.admin.bodies import PassThrough, required
from omlx.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    OMLXError,
    UpstreamError,
)
from omlx.server.auth import require_admin

log = logging.getLogger("omlx.admin.downloads")

DEFAULT_ENDPOINT = "https://huggingface.co"
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]{0,95}(/[A-Za-z0-9][\w.\-]{0,95})?$")
# Files oMLX never loads; skipped when the repo has safetensors weights.
SKIPPED = ("*.bin", "*.pth", "*.pt", "*.gguf", "*.onnx", "*.onnx_data", "*.h5", "*.msgpack",
           "*.ot", "*.tflite", "original/*", "onnx/*", "openvino/*", "coreml/*", ".gitattributes")
ACTIVE = ("queued", "preparing", "downloading")


def hub_endpoint(settings: Any) -> str:
    """`hf_endpoint` setting, then `HF_ENDPOINT`, then the public hub."""
    return (settings.hf_endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def check_repo_id(repo_id: Any) -> str:
    if not isinstance(repo_id, str) or not REPO_ID.match(repo_id) or ".." in repo_id:
        raise InvalidRequestError(
            "repo_id must look like 'org/name' (letters, digits, '-', '_', '.').", param="repo_id"
        )
    return repo_id


def hub_call(endpoint: str, what: str, fn: Callable[[], Any]) -> Any:
    """Run a huggingface_hub call; turn its failures into our error classes."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return fn()
    except GatedRepoError:
        raise UpstreamError(
            f"{what} is gated on {endpoint}: accept its terms on the hub and set HF_TOKEN.",
            code="gated_repo",
        ) from None
    except RepositoryNotFoundError:
        raise NotFoundError(
            f"{what} was not found on {endpoint} (a private model needs HF_TOKEN).", code="repo_not_found"
        ) from None
    except RevisionNotFoundError:
        raise NotFoundError(f"{what}: no such revision on {endpoint}.", code="revision_not_found") from None
    except HfHubHTTPError as exc:
        raise UpstreamError(f"The hub at {endpoint} failed for {what}: {' '.join(str(exc).split())[:300]}") from None
    except Exception as exc:  # connection refused, DNS, TLS, timeouts: one message for all
        raise UpstreamError(f"Cannot reach the hub at {endpoint}: {type(exc).__name__}: {exc}") from None


def select_files(siblings: list[Any]) -> tuple[list[str], int]:
    """The files to fetch and their total size; refuses repos oMLX cannot load."""
    names = {s.rfilename: (s.size or 0) for s in siblings}
    if not any(n.endswith(".safetensors") for n in names):
        raise InvalidRequestError(
            "This repository has no *.safetensors weights, which oMLX needs "
            "(look for an MLX or safetensors conversion of the model).",
            param="repo_id",
        )
    if "config.json" not in names:
        raise InvalidRequestError("This repository has no config.json at its top level.", param="repo_id")
    chosen = [n for n in sorted(names) if not any(fnmatch.fnmatch(n, p) for p in SKIPPED)]
    return chosen, sum(names[n] for n in chosen)


def drop_partials(folder: Path) -> None:
    """Remove `*.incomplete` files a killed download left behind.

    huggingface_hub 2.x writes each attempt to a fresh temp file, so they are never resumed;
    finished files are kept and skipped by the next attempt.
    """
    for path in (folder / ".cache" / "huggingface" / "download").rglob("*.incomplete"):
        path.unlink(missing_ok=True)


def staged_bytes(folder: Path) -> int:
    """Bytes written so far: finished files plus huggingface_hub's `.incomplete` parts."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            if name.endswith((".lock", ".metadata")):
                continue
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
    return total


@dataclass
class DownloadJob:
    id: str
    repo_id: str
    revision: str | None
    target: Path
    staging: Path
    state: str = "queued"
    total_bytes: int = 0
    downloaded_bytes: int = 0
    files: int = 0
    bytes_per_s: float = 0.0
    error: str | None = None
    commit: str | None = None
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "state": self.state,
            "total_bytes": self.total_bytes,
            "downloaded_bytes": self.downloaded_bytes,
            "progress": (self.downloaded_bytes / self.total_bytes) if self.total_bytes else 0.0,
            "files": self.files,
            "bytes_per_s": self.bytes_per_s,
            "error": self.error,
            "target": str(self.target),
            "created": self.created,
            "started": self.started,
            "finished": self.finished,
        }


class DownloadManager:
    def __init__(self, settings: Any, on_complete: Callable[[], None] | None = None, poll: float = 0.4):
        self.settings = settings
        self.on_complete = on_complete
        self.poll = poll
        self.jobs: dict[str, DownloadJob] = {}
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return hub_endpoint(self.settings)

    @property
    def model_dir(self) -> Path:
        return Path(self.settings.model_dir)

    def target_for(self, repo_id: str) -> Path:
        return self.model_dir.joinpath(*repo_id.split("/"))

    # ----- hub queries (blocking; call through asyncio.to_thread) -----------------------
    def search(self, query: str, limit: int, mlx_only: bool) -> list[dict[str, Any]]:
        from huggingface_hub import HfApi

        endpoint = self.endpoint
        api = HfApi(endpoint=endpoint)
        found = hub_call(
            endpoint,
            "the search",
            lambda: list(
                api.list_models(
                    search=query or None, filter="mlx" if mlx_only else None, sort="downloads", limit=limit
                )
            ),
        )
        return [
            {
                "id": m.id,
                "downloads": getattr(m, "downloads", None),
                "likes": getattr(m, "likes", None),
                "last_modified": m.last_modified.isoformat() if getattr(m, "last_modified", None) else None,
                "pipeline_tag": getattr(m, "pipeline_tag", None),
                "tags": list(getattr(m, "tags", None) or [])[:12],
                "local": self.target_for(m.id).exists(),
            }
            for m in found
        ]

    def info(self, repo_id: str, revision: str | None = None) -> dict[str, Any]:
        from huggingface_hub import HfApi

        endpoint = self.endpoint
        api = HfApi(endpoint=endpoint)
        m = hub_call(
            endpoint, f"model '{repo_id}'", lambda: api.model_info(repo_id, revision=revision, files_metadata=True)
        )
        siblings = list(m.siblings or [])
        try:
            chosen, download_bytes = select_files(siblings)
            problem = None
        except InvalidRequestError as exc:
            chosen, download_bytes, problem = [], 0, exc.message
        return {
            "id": m.id,
            "sha": m.sha,
            "downloads": getattr(m, "downloads", None),
            "likes": getattr(m, "likes", None),
            "pipeline_tag": getattr(m, "pipeline_tag", None),
            "library_name": getattr(m, "library_name", None),
            "tags": list(m.tags or []),
            "gated": getattr(m, "gated", None),
            "files": [{"name": s.rfilename, "size": s.size, "download": s.rfilename in chosen} for s in siblings],
            "total_bytes": sum(s.size or 0 for s in siblings),
            "download_bytes": download_bytes,
            "loadable": problem is None,
            "problem": problem,
            "local": self.target_for(m.id).exists(),
            "target": str(self.target_for(m.id)),
        }

    # ----- jobs -------------------------------------------------------------------------
    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [j.public() for j in sorted(self.jobs.values(), key=lambda j: j.created, reverse=True)]

    def get(self, job_id: str) -> DownloadJob:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"No download with id '{job_id}'.")
        return job

    def start(self, repo_id: Any, revision: Any = None) -> DownloadJob:
        repo_id = check_repo_id(repo_id)
        if revision is not None and (
            not isinstance(revision, str) or not 0 < len(revision) <= 200 or ".." in revision
        ):
            raise InvalidRequestError("revision must be a branch, tag or commit.", param="revision")
        target = self.target_for(repo_id)
        with self._lock:
            for job in self.jobs.values():
                if job.repo_id == repo_id and job.state in ACTIVE:
                    raise ConflictError(f"'{repo_id}' is already downloading.")
            if target.exists():
                raise ConflictError(
                    f"{target} already exists; delete the model first to download it again.", code="exists"
                )
            for old in [j for j in self.jobs.values() if j.repo_id == repo_id]:
                del self.jobs[old.id]  # a new attempt replaces finished ones (partial files are kept)
            job = DownloadJob(
                id=secrets.token_hex(6),
                repo_id=repo_id,
                revision=revision,
                target=target,
                staging=self.model_dir / ".downloads" / repo_id.replace("/", "--"),
            )
            self.jobs[job.id] = job
        self._launch(job)
        return job

    def retry(self, job_id: str) -> DownloadJob:
        job = self.get(job_id)
        with self._lock:
            if job.state not in ("failed", "cancelled"):
                raise ConflictError(f"Download {job_id} is {job.state}; only failed or cancelled ones can be retried.")
            if any(j.repo_id == job.repo_id and j.state in ACTIVE for j in self.jobs.values()):
                raise ConflictError(f"'{job.repo_id}' is already downloading.")
            job.state, job.error, job.finished = "queued", None, None
            job.cancel = threading.Event()
        self._launch(job)
        return job

    def cancel(self, job_id: str) -> DownloadJob:
        job = self.get(job_id)
        if job.state not in ACTIVE:
            raise ConflictError(f"Download {job_id} is {job.state}, not running.")
        job.cancel.set()
        proc = job.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
        return job

    def remove(self, job_id: str) -> None:
        """Forget a finished job; drop the partial files of an unfinished one."""
        job = self.get(job_id)
        if job.state in ACTIVE:
            raise ConflictError(f"Download {job_id} is {job.state}; cancel it first.")
        with self._lock:
            self.jobs.pop(job_id, None)
        shutil.rmtree(job.staging, ignore_errors=True)

    def shutdown(self) -> None:
        for job in list(self.jobs.values()):
            if job.state in ACTIVE:
                job.cancel.set()
                if job.proc is not None and job.proc.poll() is None:
                    job.proc.kill()

    def _launch(self, job: DownloadJob) -> None:
        threading.Thread(target=self._run, args=(job,), name=f"download:{job.repo_id}", daemon=True).start()

    # ----- the worker thread ------------------------------------------------------------
    def _run(self, job: DownloadJob) -> None:
        job.started, job.state = time.time(), "preparing"
        endpoint = self.endpoint
        try:
            from huggingface_hub import HfApi

            api = HfApi(endpoint=endpoint)
            info = hub_call(
                endpoint,
                f"model '{job.repo_id}'",
                lambda: api.model_info(job.repo_id, revision=job.revision, files_metadata=True),
            )
            files, total = select_files(list(info.siblings or []))
            job.commit, job.files, job.total_bytes = info.sha, len(files), total
            if job.cancel.is_set():
                return self._finish(job, "cancelled")
            job.state = "downloading"
            log.info("downloading %s (%d files, %d bytes) from %s", job.repo_id, len(files), total, endpoint)
            rc, error = self._fetch(job, endpoint, files)
            if job.cancel.is_set():
                return self._finish(job, "cancelled")
            if rc != 0:
                return self._finish(job, "failed", error or f"the download process exited with {rc}")
            job.downloaded_bytes = total
            self._place(job)
            self._finish(job, "completed")
            if self.on_complete is not None:
                self.on_complete()
        except OMLXError as exc:
            self._finish(job, "failed", exc.message)
        except OSError as exc:
            self._finish(job, "failed", f"{type(exc).__name__}: {exc}")

    def _fetch(self, job: DownloadJob, endpoint: str, files: list[str]) -> tuple[int, str | None]:
        job.staging.mkdir(parents=True, exist_ok=True)
        drop_partials(job.staging)
        spec = {"repo_id": job.repo_id, "revision": job.commit, "local_dir": str(job.staging),
                "endpoint": endpoint, "files": files}
        env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
        with tempfile.TemporaryFile() as errors:
            job.proc = subprocess.Popen(
                [sys.executable, "-m", "omlx.admin.hf_fetch"],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errors, env=env,
            )
            assert job.proc.stdin is not None
            job.proc.stdin.write(json.dumps(spec).encode())
            job.proc.stdin.close()
            last_bytes, last_t = staged_bytes(job.staging), time.monotonic()
            while job.proc.poll() is None:
                if job.cancel.wait(self.poll):
                    job.proc.terminate()
                    try:
                        job.proc.wait(10)
                    except subprocess.TimeoutExpired:
                        job.proc.kill()
                        job.proc.wait()
                    break
                now_bytes, now = staged_bytes(job.staging), time.monotonic()
                job.downloaded_bytes = min(now_bytes, job.total_bytes)
                rate = (now_bytes - last_bytes) / max(now - last_t, 1e-6)
                job.bytes_per_s = rate if not job.bytes_per_s else 0.7 * job.bytes_per_s + 0.3 * rate
                last_bytes, last_t = now_bytes, now
            rc = job.proc.wait()
            if rc != 0:
                drop_partials(job.staging)
            job.downloaded_bytes = min(staged_bytes(job.staging), job.total_bytes)
            errors.seek(0)
            lines = [ln for ln in errors.read().decode(errors="replace").splitlines() if ln.startswith("error: ")]
        job.proc = None
        return rc, (lines[-1][7:] if lines else None)

    def _place(self, job: DownloadJob) -> None:
        if job.target.exists():
            raise ConflictError(f"{job.target} appeared while downloading; the files stay in {job.staging}.")
        job.target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(job.staging, job.target)
        staging_root = job.staging.parent
        if staging_root.exists() and not any(staging_root.iterdir()):
            staging_root.rmdir()

    def _finish(self, job: DownloadJob, state: str, error: str | None = None) -> None:
        job.state, job.error, job.finished, job.bytes_per_s = state, error, time.time(), 0.0
        if state == "failed":
            log.warning("download of %s failed: %s", job.repo_id, error)
        else:
            log.info("download of %s %s", job.repo_id, state)


# ----- routes ------------------------------------------------------------------------------
router = APIRouter(prefix="/api", dependencies=[Depends(require_admin)])


class DownloadBody(PassThrough):
    """A hub repo to download into the model dir (checked by `DownloadManager.start`)."""

    model_config = required("repo_id")
    repo_id: SkipValidation[str] = Field(None, description="'org/name' on the hub")
    revision: SkipValidation[str | None] = Field(None, description="A branch, tag or commit; the default branch if unset")


def _manager(request: Request) -> DownloadManager:
    return request.app.state.downloads


@router.get("/hub/search")
async def hub_search(request: Request, q: str = "", limit: int = 20, mlx: bool = True) -> dict[str, Any]:
    if not 1 <= limit <= 100:
        raise InvalidRequestError("limit must be between 1 and 100.", param="limit")
    manager = _manager(request)
    results = await asyncio.to_thread(manager.search, q.strip(), limit, mlx)
    return {"endpoint": manager.endpoint, "results": results}


@router.get("/hub/models/{repo_id:path}")
async def hub_model(repo_id: str, request: Request, revision: str | None = None) -> dict[str, Any]:
    check_repo_id(repo_id)
    return await asyncio.to_thread(_manager(request).info, repo_id, revision)


@router.get("/downloads")
async def list_downloads(request: Request) -> dict[str, Any]:
    manager = _manager(request)
    return {"endpoint": manager.endpoint, "model_dir": str(manager.model_dir), "downloads": manager.list()}


@router.post("/downloads")
async def start_download(request: Request, body: DownloadBody) -> dict[str, Any]:
    return _manager(request).start(body.repo_id, body.revision).public()


@router.post("/downloads/{job_id}/cancel")
async def cancel_download(job_id: str, request: Request) -> dict[str, Any]:
    return _manager(request).cancel(job_id).public()


@router.post("/downloads/{job_id}/retry")
async def retry_download(job_id: str, request: Request) -> dict[str, Any]:
    return _manager(request).retry(job_id).public()


@router.delete("/downloads/{job_id}")
async def remove_download(job_id: str, request: Request) -> dict[str, Any]:
    await asyncio.to_thread(_manager(request).remove, job_id)
    return {"id": job_id, "removed": True}
