"""Local sources that are not what they seem: symlink loops, names the filesystem refuses, files
that are directories or FIFOs. Each is refused with a status naming the problem, promptly (a
FIFO is never opened for a blocking read), and the store keeps serving afterwards."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
from pathlib import Path

import grpc
import pytest

from loraserve.adapter_store.sources import LocalSource, _os_error
from loraserve.v1 import store_pb2
from tests.helpers import bad_checkpoints as bad

C = grpc.StatusCode


def _loop_dir(root: Path) -> str:
    os.symlink("loop-b", root / "loop-a")
    os.symlink("loop-a", root / "loop-b")
    return "loop-a"


def _loop_under(root: Path) -> str:
    _loop_dir(root)
    return "loop-a/inner"


def _weights_loop(root: Path) -> str:
    d = bad.copy_adapter(root / "peft-qv-r8", root / "weights-loop")
    (d / bad.WEIGHTS).unlink()
    os.symlink(bad.WEIGHTS, d / bad.WEIGHTS)
    return "weights-loop"


def _long_name(root: Path) -> str:
    return "n" * 300


def _long_name_under(root: Path) -> str:
    return "peft-qv-r8/" + "n" * 300


def _config_dir(root: Path) -> str:
    d = bad.copy_adapter(root / "peft-qv-r8", root / "config-dir")
    (d / bad.CONFIG).unlink()
    (d / bad.CONFIG).mkdir()
    return "config-dir"


def _config_fifo(root: Path) -> str:
    d = bad.copy_adapter(root / "peft-qv-r8", root / "config-fifo")
    (d / bad.CONFIG).unlink()
    os.mkfifo(d / bad.CONFIG)
    return "config-fifo"


def _weights_fifo(root: Path) -> str:
    d = bad.copy_adapter(root / "peft-qv-r8", root / "weights-fifo")
    (d / bad.WEIGHTS).unlink()
    os.mkfifo(d / bad.WEIGHTS)
    return "weights-fifo"


CASES = [
    ("symlink-loop", _loop_dir, C.INVALID_ARGUMENT, ["'loop-a'", "symlink loop"]),
    ("symlink-loop-under", _loop_under, C.INVALID_ARGUMENT, ["'loop-a/inner'", "symlink loop"]),
    ("weights-symlink-loop", _weights_loop, C.INVALID_ARGUMENT, [bad.WEIGHTS, "symlink loop"]),
    ("name-too-long", _long_name, C.INVALID_ARGUMENT, ["File name too long"]),
    ("name-too-long-under", _long_name_under, C.INVALID_ARGUMENT, ["File name too long"]),
    ("config-is-a-directory", _config_dir, C.INVALID_ARGUMENT, [bad.CONFIG, "not a regular file"]),
    ("config-is-a-fifo", _config_fifo, C.INVALID_ARGUMENT, [bad.CONFIG, "not a regular file"]),
    ("weights-is-a-fifo", _weights_fifo, C.INVALID_ARGUMENT, [bad.WEIGHTS, "not a regular file"]),
]


@pytest.mark.parametrize("setup,code,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_odd_local_sources_are_refused(setup, code, fragments, stub, adapter_root: Path) -> None:
    source = setup(adapter_root)
    request = store_pb2.RegisterAdapterRequest(adapter_id="candidate", source=source)
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterAdapter(request, timeout=10)
    assert err.value.code() == code, err.value.details()
    for f in fragments:
        assert f in err.value.details(), (f, err.value.details())
    # and the store still registers a good adapter
    ok = store_pb2.RegisterAdapterRequest(adapter_id="good", source="peft-qv-r8")
    assert stub.RegisterAdapter(ok, timeout=30).adapter_id == "good"


def test_a_source_file_is_read_through_a_blocking_descriptor(adapter_root: Path, monkeypatch) -> None:
    """Opened O_NONBLOCK (so that a FIFO cannot hold the thread), a regular file is read blocking:
    a non-blocking read of a file an HSM has migrated fails EAGAIN instead of waiting for it."""
    flags: list[int] = []
    fdopen = os.fdopen

    def watched(fd: int, *args, **kwargs):
        flags.append(fcntl.fcntl(fd, fcntl.F_GETFL))
        return fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", watched)
    data = LocalSource(adapter_root, "peft-qv-r8").read(bad.CONFIG, 1 << 20)
    monkeypatch.undo()
    assert data.startswith(b"{") and len(flags) == 1
    assert not flags[0] & os.O_NONBLOCK


def test_a_file_under_another_process_lease_is_unavailable(stub, adapter_root: Path) -> None:
    """A lease holder (a file server, a backup agent) makes an open fail EWOULDBLOCK until it lets
    go: UNAVAILABLE, which clients retry, not FAILED_PRECONDITION; afterwards it registers."""
    d = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "leased")
    previous = signal.signal(signal.SIGIO, signal.SIG_IGN)  # the lease break's notice
    fd = os.open(d / bad.CONFIG, os.O_RDWR)
    try:
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as exc:
            pytest.skip(f"no file leases here: {exc}")
        request = store_pb2.RegisterAdapterRequest(adapter_id="leased", source="leased")
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterAdapter(request, timeout=10)
        assert err.value.code() == C.UNAVAILABLE, err.value.details()
        assert bad.CONFIG in err.value.details()
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    finally:
        os.close(fd)
        signal.signal(signal.SIGIO, previous)
    assert stub.RegisterAdapter(request, timeout=30).adapter_id == "leased"


@pytest.mark.parametrize(
    "code,status",
    [(errno.EIO, "UNAVAILABLE"), (errno.ESTALE, "UNAVAILABLE"), (errno.ETIMEDOUT, "UNAVAILABLE")]
    + [(errno.EAGAIN, "UNAVAILABLE"), (errno.EINTR, "UNAVAILABLE"), (errno.ENOLCK, "UNAVAILABLE")]
    + [(errno.EMFILE, "UNAVAILABLE"), (errno.ENFILE, "UNAVAILABLE"), (errno.ENOMEM, "UNAVAILABLE")]
    + [(errno.ENOBUFS, "UNAVAILABLE")]
    + [(errno.EACCES, "FAILED_PRECONDITION"), (errno.EPERM, "FAILED_PRECONDITION")],
)
def test_filesystem_failures_that_pass_are_unavailable(code: int, status: str) -> None:
    assert _os_error(OSError(code, os.strerror(code)), "src/f").code == status


def _failing_once(real, code: int, when):
    """`real`, except that its first call for which `when(args)` holds raises OSError(code)."""
    failed: list[int] = []

    def call(*args, **kwargs):
        if not failed and when(args):
            failed.append(code)
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    return call, failed


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM])
@pytest.mark.parametrize("at", ["open", "fstat"])
def test_a_source_read_out_of_descriptors_or_memory_is_unavailable(
    code: int, at: str, stub, adapter_root: Path, monkeypatch
) -> None:
    """The store's process (or the host) out of file descriptors or kernel memory as it opens or
    stats a source file: UNAVAILABLE, which clients retry, naming the file and what ran out; the
    same registration sent again once it passes succeeds."""
    if at == "open":
        call, failed = _failing_once(os.open, code, lambda args: str(args[0]).endswith(bad.WEIGHTS))
    else:
        weights = lambda args: os.readlink(f"/proc/self/fd/{args[0]}").endswith(bad.WEIGHTS)  # noqa: E731
        call, failed = _failing_once(os.fstat, code, weights)
    monkeypatch.setattr(os, at, call)
    request = store_pb2.RegisterAdapterRequest(adapter_id="x", source="peft-qv-r8")
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterAdapter(request, timeout=10)
    assert failed == [code]
    assert err.value.code() == C.UNAVAILABLE, err.value.details()
    for fragment in (bad.WEIGHTS, os.strerror(code), "retry"):
        assert fragment in err.value.details(), (fragment, err.value.details())
    assert stub.RegisterAdapter(request, timeout=30).adapter_id == "x"
