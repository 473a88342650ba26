"""Where PEFT checkpoints come from: one abstract source, a local directory under the adapter root
or an S3 prefix. Both refuse anything outside what they were given (path traversal, symlinks out
of the root, keys built from unvalidated parts) and check file sizes before reading."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loraserve.adapter_store.checkpoint import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    PICKLE_FILE,
    PICKLE_MESSAGE,
    WEIGHTS_FILE,
)
from loraserve.adapter_store.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    StoreError,
    Unavailable,
)

# checked with fullmatch: `$` would also match before a trailing newline
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_KEY_PART_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,254}")
MAX_SOURCE_LEN = 1024


class AdapterSource(ABC):
    """A directory-like place holding adapter_config.json and adapter_model.safetensors."""

    uri: str  # canonical form, recorded in the registry and parsed again on rebuild

    @abstractmethod
    def size(self, name: str) -> int | None:
        """Size in bytes of file `name`, None when absent."""

    @abstractmethod
    def read(self, name: str, max_bytes: int) -> bytes:
        """Contents of file `name`; NotFound when absent, InvalidArgument when over max_bytes."""

    def read_checkpoint_files(self, max_weights_bytes: int) -> tuple[bytes, bytes]:
        """(adapter_config.json, adapter_model.safetensors); a pickle-only checkpoint is refused."""
        if self.size(WEIGHTS_FILE) is None:
            if self.size(PICKLE_FILE) is not None:
                raise InvalidArgument(f"{self.uri}: {PICKLE_MESSAGE}")
            raise NotFound(f"{self.uri}: {WEIGHTS_FILE} not found")
        config = self.read(CONFIG_FILE, MAX_CONFIG_BYTES)
        weights = self.read(WEIGHTS_FILE, max_weights_bytes)
        return config, weights


class LocalSource(AdapterSource):
    def __init__(self, root: Path, relative: str) -> None:
        self.root = root.resolve()
        directory = _resolve(self.root / relative, f"source {relative!r}")
        if not directory.is_relative_to(self.root):
            raise InvalidArgument(f"source {relative!r} resolves outside the adapter root")
        self.directory = directory
        self.uri = str(directory.relative_to(self.root)) or "."

    def _path(self, name: str) -> Path:
        path = _resolve(self.directory / name, f"{self.uri}/{name}")
        if not path.is_relative_to(self.root):
            raise InvalidArgument(f"{self.uri}/{name} is a symlink that leaves the adapter root")
        return path

    def size(self, name: str) -> int | None:
        """Size of whatever is at `name`: read() refuses anything but a regular file."""
        try:
            return self._path(name).stat().st_size
        except OSError as exc:
            err = _os_error(exc, f"{self.uri}/{name}")
            if isinstance(err, NotFound):
                return None
            raise err from exc

    def read(self, name: str, max_bytes: int) -> bytes:
        path = self._path(name)
        where = f"{self.uri}/{name}"
        try:
            # O_NONBLOCK: opening a FIFO for reading would wait for a writer (and hold the thread)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            raise _os_error(exc, where) from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument(f"{where} is not a regular file")
            # blocking again: a read of a file an HSM has migrated would fail EAGAIN (and a
            # buffered read return None) instead of waiting for the file's recall
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise _os_error(exc, where) from exc
            raise
        with os.fdopen(fd, "rb") as f:
            if st.st_size > max_bytes:
                raise InvalidArgument(f"{where} is {st.st_size} bytes, over the limit of {max_bytes}")
            try:
                data = f.read(max_bytes + 1)
            except OSError as exc:
                raise _os_error(exc, where) from exc
        if len(data) > max_bytes:
            raise InvalidArgument(f"{where} grew over the limit of {max_bytes} bytes while read")
        return data


def _resolve(path: Path, what: str) -> Path:
    """path.resolve(), with a symlink loop or a name the filesystem refuses as a StoreError."""
    try:
        return path.resolve()
    except RuntimeError:  # Python < 3.13 reports a symlink loop with RuntimeError
        raise InvalidArgument(f"{what} is a symlink loop") from None
    except OSError as exc:
        raise _os_error(exc, what) from exc


# Failures that pass (an I/O error, a stale NFS handle, a timeout, a lease held by another
# process, which an open with O_NONBLOCK meets as EWOULDBLOCK while the lease is broken): UNAVAILABLE,
# which clients retry.
TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, errno.ETIMEDOUT, errno.ESTALE, errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR, errno.ENOLCK}
)
# The store's process or host short of file descriptors or kernel memory: it passes as other work
# ends, so UNAVAILABLE as well (RESOURCE_EXHAUSTED is a client's own quota, and clients do not
# retry it), not FAILED_PRECONDITION, which no client retries.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def _os_error(exc: OSError, what: str) -> StoreError:
    """Classify a filesystem failure on a local source: absent -> NOT_FOUND, a name that cannot be
    a checkpoint (too long, a symlink loop) -> INVALID_ARGUMENT, a transient failure or the store
    short of descriptors or memory -> UNAVAILABLE, anything else (permissions) -> FAILED_PRECONDITION."""
    if exc.errno in RESOURCE_ERRNOS:
        return Unavailable(
            f"{what}: cannot read now, the store is short of a resource ({exc.strerror}); retry later"
        )
    if exc.errno in TRANSIENT_ERRNOS:
        return Unavailable(f"{what}: cannot read now: {exc.strerror}")
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return NotFound(f"{what} not found")
    if exc.errno == errno.ELOOP:
        return InvalidArgument(f"{what} is a symlink loop")
    if exc.errno in (errno.ENAMETOOLONG, errno.EISDIR):
        return InvalidArgument(f"{what}: {exc.strerror}")
    return FailedPrecondition(f"{what}: cannot read: {exc.strerror}")


class S3Source(AdapterSource):
    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix
        self.uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def size(self, name: str) -> int | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except Exception as exc:
            err = s3_error(exc, f"s3://{self.bucket}/{self._key(name)}")
            if isinstance(err, NotFound):
                return None
            raise err from exc
        return int(head["ContentLength"])

    def read(self, name: str, max_bytes: int) -> bytes:
        """One GET; its ContentLength is checked against max_bytes before the body is read."""
        where = f"s3://{self.bucket}/{self._key(name)}"
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
        except Exception as exc:
            raise s3_error(exc, where) from exc
        body = response["Body"]
        try:
            size = int(response["ContentLength"])
            if size > max_bytes:
                raise InvalidArgument(f"{where} is {size} bytes, over the limit of {max_bytes}")
            data = body.read(max_bytes + 1)
        except StoreError:
            raise
        except Exception as exc:
            raise s3_error(exc, where) from exc
        finally:
            body.close()
        if len(data) > max_bytes:
            raise InvalidArgument(f"{where} is over the limit of {max_bytes} bytes")
        return data


def s3_error(exc: Exception, where: str) -> StoreError:
    """Classify a boto3/botocore failure: missing key -> NOT_FOUND, endpoint down -> UNAVAILABLE."""
    from botocore.exceptions import ClientError, ConnectionError, NoCredentialsError, ReadTimeoutError

    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket") or status == 404:
            return NotFound(f"{where} not found ({code or status})")
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
            return FailedPrecondition(f"S3 refused access to {where} ({code}); check the store's credentials")
        if status is not None and int(status) >= 500:
            return Unavailable(f"S3 failed reading {where}: {code} (HTTP {status})")
        return FailedPrecondition(f"S3 error reading {where}: {code or exc}")
    if isinstance(exc, NoCredentialsError):
        return FailedPrecondition(f"no AWS credentials configured to read {where}")
    if isinstance(exc, (ConnectionError, ReadTimeoutError)):
        return Unavailable(f"S3 endpoint unreachable reading {where}: {exc}")
    return Unavailable(f"S3 request for {where} failed: {type(exc).__name__}: {exc}")


class SourceResolver:
    """Parses a RegisterAdapter source string into an AdapterSource."""

    def __init__(self, root: Path, s3_client_factory: Callable[[], Any]) -> None:
        self.root = root
        self._s3_factory = s3_client_factory
        self._s3: Any = None

    def resolve(self, source: str) -> AdapterSource:
        if not source or len(source) > MAX_SOURCE_LEN or "\x00" in source:
            raise InvalidArgument(f"source must be 1..{MAX_SOURCE_LEN} characters without NUL")
        if source.startswith("s3://"):
            bucket, prefix = parse_s3(source)
            if self._s3 is None:
                self._s3 = self._s3_factory()
            return S3Source(self._s3, bucket, prefix)
        if "://" in source:
            raise InvalidArgument(f"source {source!r}: only s3:// URLs and local directories are supported")
        return LocalSource(self.root, source)


def parse_s3(source: str) -> tuple[str, str]:
    """s3://bucket/a/b -> ("bucket", "a/b"); every part validated so no key can escape the prefix."""
    bucket, _, prefix = source[len("s3://") :].partition("/")
    if not _BUCKET_RE.fullmatch(bucket):
        raise InvalidArgument(f"source {source!r}: {bucket!r} is not a valid S3 bucket name")
    parts = [p for p in prefix.strip("/").split("/")] if prefix.strip("/") else []
    for part in parts:
        if not _KEY_PART_RE.fullmatch(part) or part in (".", "..") or ".." in part:
            raise InvalidArgument(f"source {source!r}: key part {part!r} is not allowed")
    return bucket, "/".join(parts)


def boto3_s3_factory(endpoint_url: str | None, region: str | None, timeout_s: float) -> Callable[[], Any]:
    """boto3 S3 client from the standard AWS configuration plus the store's endpoint/region flags."""

    def make() -> Any:
        import boto3
        from botocore.config import Config

        cfg = Config(
            connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 2, "mode": "standard"}
        )
        return boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region, config=cfg)

    return make
