"""Finding the daemon that serves a device.

The daemon is identified by the GPU's UUID, never by an ordinal: ordinals
change under ``CUDA_VISIBLE_DEVICES``, UUIDs do not. The client never applies
the daemon's runtime-dir rule; it looks for an existing ``<GPU-UUID>.sock``
in a fixed order (docs/DESIGN.md section 4), and ``CACHE_DIT_OPD_ADDRESS``
overrides the lookup.
"""

from __future__ import annotations

import os
import re

ADDRESS_ENV = "CACHE_DIT_OPD_ADDRESS"
RUNTIME_DIR_ENV = "CACHE_DIT_OPD_RUNTIME_DIR"
DAEMON_BINARY = "cache-dit-opd"
BUILD_PATH_HINT = "build/server/cache-dit-opd"


_UUID = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def format_uuid(raw: bytes) -> str:
    """16 raw bytes -> "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", the form of common/gpu_uuid.h."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID has 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def is_gpu_uuid(text: str) -> bool:
    """True for "GPU-" + 8-4-4-4-12 hex digits (either case), nothing else (common/gpu_uuid.h IsGpuUuid)."""
    return _UUID.fullmatch(text) is not None


def gpu_uuid(device) -> str:
    """UUID of a torch CUDA device, from the 16 bytes torch.cuda.get_device_properties(device).uuid holds.

    Under MIG those are the compute instance's own bytes, so this is the key its daemon binds
    (common/gpu_uuid.h says why "MIG-..." is not one).
    """
    import torch

    uuid = torch.cuda.get_device_properties(device).uuid
    raw = getattr(uuid, "bytes", None)
    if raw is None:  # older torch: only the text "xxxxxxxx-xxxx-...", without a prefix
        digits = str(uuid).removeprefix("GPU-").replace("-", "")
        try:
            raw = bytes.fromhex(digits)
        except ValueError:
            raw = b""
        if len(raw) != 16:
            raise RuntimeError(f"cache_dit_opd: cannot read a GPU UUID from {str(uuid)!r} (cuda:{device})")
    return format_uuid(bytes(raw))


def candidate_dirs() -> list[str]:
    """Directories searched for ``<GPU-UUID>.sock``, in order (duplicates removed)."""
    dirs = []
    if os.environ.get(RUNTIME_DIR_ENV):
        dirs.append(os.environ[RUNTIME_DIR_ENV])
    dirs.append("/run/cache-dit-opd")
    if os.environ.get("XDG_RUNTIME_DIR"):
        dirs.append(os.path.join(os.environ["XDG_RUNTIME_DIR"], "cache-dit-opd"))
    dirs.append("/tmp/cache-dit-opd")
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def normalize_address(address: str) -> str:
    """A gRPC target from CACHE_DIT_OPD_ADDRESS: a bare path becomes unix:<path>."""
    address = address.strip()
    if address.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/") or address.startswith("."):
        return "unix:" + os.path.abspath(address)
    return address


def find_daemon(uuid: str) -> tuple[str | None, list[str]]:
    """(gRPC target or None, the places looked at) for the daemon serving ``uuid``."""
    override = os.environ.get(ADDRESS_ENV)
    if override:
        return normalize_address(override), [f"{ADDRESS_ENV}={override}"]
    if not is_gpu_uuid(uuid):  # it becomes a file name: refuse anything else before touching the filesystem
        raise ValueError(f"cache_dit_opd: {uuid!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
    looked = []
    for d in candidate_dirs():
        path = os.path.join(d, f"{uuid}.sock")
        looked.append(path)
        if os.path.exists(path):
            return "unix:" + path, looked
    return None, looked


def start_command(device_index: int, uuid: str) -> str:
    """The exact command that starts a daemon for this process's ``cuda:<device_index>``."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return f"{DAEMON_BINARY} --device {device_index}"
    # The ordinal is this process's view; pin the daemon to the same GPU by UUID.
    return f"CUDA_VISIBLE_DEVICES={uuid} {DAEMON_BINARY} --device 0"
