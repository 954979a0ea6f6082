"""What this kernel allows, probed apart from the plugin, for tests whose expectation depends on it."""

from __future__ import annotations

import ctypes
import os


def io_uring_available() -> bool:
    """Whether the process may make an io_uring: io_uring_setup of 2 entries (system call 425 on x86_64 and
    aarch64); a seccomp filter or an old kernel refuses it."""
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    fd = libc.syscall(ctypes.c_long(425), ctypes.c_uint(2), params)
    if fd < 0:
        return False
    os.close(fd)
    return True
