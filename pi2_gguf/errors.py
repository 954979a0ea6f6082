"""Errors pi2-gguf raises for bad input; each message names the file or setting at fault."""

from __future__ import annotations

from pathlib import Path


class Pi2Error(Exception):
    """Base class of pi2-gguf's errors."""

    # finished work an interrupted command kept for a rerun to resume (convert's work directory), said with the error
    kept: Path | None = None


class ModelFileError(Pi2Error):
    """A model file is missing, unreadable, not GGUF, or truncated."""


class VersionMismatchError(Pi2Error):
    """The installed llama-cpp-python (or the plugin build) is not the pinned version."""


class PluginError(Pi2Error):
    """The PI2 plugin could not be found or registered."""


class ModelFetchError(Pi2Error):
    """A model could not be fetched from its PyPI packages or failed verification."""


class SidecarError(Pi2Error):
    """A pi2 sidecar is missing, unreadable, not of this format version, inconsistent, or made for
    another model (the message is the C reader's: "sidecar PATH: problem")."""


class SidecarVersionError(SidecarError):
    """A pi2 sidecar of another format version: convert the model again."""


class MemoryBudgetError(Pi2Error):
    """A memory budget is malformed, or too small to run the model (the message states the minimum)."""


class MissingExtraError(Pi2Error):
    """An optional dependency is not installed; the message names the extra that brings it."""


class ConfigError(Pi2Error, ValueError):
    """A PI2_* setting was refused (the message is the plugin's: "PI2_DOWN_SPARSE_MAX=2 is not a fraction
    in 0..1")."""


class CheckpointImportError(Pi2Error):
    """A Hugging Face checkpoint could not be imported (`pi2-gguf import`); the message says which file and why."""


class OutputWriteError(Pi2Error):
    """An output file could not be written (no space, no permission, a missing directory); nothing was left
    behind: the temp file it was written to is removed and an existing file of that name is untouched."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived (pi2_gguf.interrupts). A BaseException, as KeyboardInterrupt is, so that no
    `except Exception` swallows it on its way out through the cleanups of the work it interrupts."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        self.name = signal.Signals(signum).name
        self.kept: Path | None = None  # as Pi2Error.kept
        super().__init__(f"interrupted by {self.name}")
