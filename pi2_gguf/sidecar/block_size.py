"""The default bundle alignment: the logical block size of the device a sidecar is written to.

O_DIRECT reads (the plugin's bundle reads under a memory budget) need offsets and sizes that are multiples
of the device's logical block size. Bundles padded to 512 bytes instead of 4 KiB read fewer bytes per token
(Qwen2.5-Coder-1.5B under 600 MB: 3 KiB bundles instead of 4 KiB, docs/MEASUREMENTS.md 2026-11-22), and on a
4 KiB-block device (UFS flash) 512-byte offsets are refused, so the plugin reads them through the page cache
instead. convert therefore aligns to the block size of the device it writes to, where that is known."""

from __future__ import annotations

import os
from pathlib import Path

from . import format as fmt


def logical_block_size(path: Path) -> int | None:
    """Logical block size in bytes of the block device holding `path` (an existing file or directory), from
    sysfs; None where there is none (tmpfs, overlay, network file systems) or it cannot be read."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    # a partition has no queue/ of its own: its disk's is one level up
    for queue in (node / "queue", node / ".." / "queue"):
        try:
            return int((queue / "logical_block_size").read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def default_bundle_align(out: Path) -> tuple[int, str]:
    """(alignment, why) for a sidecar written to `out`: the logical block size of its device when it is one of
    the format's alignments (512-4096), else the format's largest, 4096, which suits every device."""
    size = logical_block_size(out.parent)
    if size in fmt.BUNDLE_ALIGNS:
        return size, f"the logical block size of the device holding {out.parent}"
    if size is None:
        return fmt.BUNDLE_ALIGN, f"no block device found for {out.parent}"
    return fmt.BUNDLE_ALIGN, f"{out.parent}'s device has {size}-byte blocks, not one of {fmt.BUNDLE_ALIGNS}"
