"""Persistent per-GPU store of autotuning results.

What: one JSON file per device model (``nvidia-h100-80gb-hbm3.json``) mapping a tuning key
(layer dims, dtype, ...) to the caller's record of what was measured and chosen. File format::

    {"schema": 1, "device": "NVIDIA H100 80GB HBM3",
     "versions": {"dpgrad": "0.1.0", "torch": "2.13.0", "triton": "3.9.0"},
     "entries": {key: {"choice": "direct", ...}}}

Why: measuring every strategy for every layer shape costs seconds at start-up; a result
measured once on a GPU model holds for every later run on that model, until dpgrad, torch or
Triton change (then the kernels, and so the timings, may differ, so the whole file is stale).

It is a cache, so it never crashes a training run: an unreadable, corrupt or stale file is
ignored with one ``RuntimeWarning`` and retuned; an unwritable directory is warned about once
and the store keeps its results in memory. Several processes (DDP ranks) may ``put`` at once:
each write takes an exclusive lock, re-reads the file, merges, and replaces it atomically.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import tempfile
import threading
import warnings
import zlib

import torch

from dpgrad.version import __version__

try:  # POSIX only; without it concurrent writers may lose each other's entries, never corrupt
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

SCHEMA_VERSION = 1

# Distributions that provide the `triton` module: upstream, and PyTorch's builds of it.
_TRITON_DISTS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")


def default_dir() -> pathlib.Path:
    """Directory of the store files: ``$DPGRAD_TUNE_DIR``, else ``$XDG_CACHE_HOME/dpgrad/tune``,
    else ``~/.cache/dpgrad/tune``. Read at each call, so setting the variable after import works.
    """
    override = os.environ.get("DPGRAD_TUNE_DIR")
    if override:
        return pathlib.Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(cache).expanduser() if cache else pathlib.Path.home() / ".cache"
    return base / "dpgrad" / "tune"


def _cpu_model() -> str:
    # /proc/cpuinfo names the CPU model (timings differ between models, not just
    # architectures) and, unlike platform.processor() on Linux, spawns no `uname` subprocess.
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_name(device: torch.device | str) -> str:
    """Name of the device model that timings are measured on, stable across runs on one machine.

    CUDA (and ROCm) devices: ``torch.cuda.get_device_name`` ("NVIDIA H100 80GB HBM3"). Others:
    the device type and the CPU model ("cpu-AMD EPYC"), since the host CPU is what runs them.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-{_cpu_model()}"


def _slug(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"
    if len(slug) > 80:  # stay far below file-name limits; the hash keeps long names apart
        slug = f"{slug[:71].rstrip('-')}-{zlib.crc32(name.encode()):08x}"
    return slug


def store_path(device_name: str, directory: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the store file for a device model: ``<directory>/<slug>.json``, where the slug is
    the lower-cased name with runs of other characters turned into '-'
    ("NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3.json"). ``directory`` defaults to
    :func:`default_dir`.
    """
    base = pathlib.Path(directory).expanduser() if directory is not None else default_dir()
    return base / f"{_slug(device_name)}.json"


def _dist_version(names) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict:
    """Versions a stored timing depends on: ``{"dpgrad", "torch", "triton"}`` (triton ``None``
    when not installed). Triton's is read from package metadata, so Triton is not imported.
    """
    return {
        "dpgrad": __version__,
        "torch": torch.__version__,
        "triton": _dist_version(_TRITON_DISTS),
    }


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The fields of a record besides "choice" (the tuner's), each with what its values must be.
_FIELDS = {
    "timings_ms": ("an object of numbers", lambda v: isinstance(v, dict) and all(_number(x) for x in v.values())),
    "spread": ("an object of numbers", lambda v: isinstance(v, dict) and all(_number(x) for x in v.values())),
    "skipped": ("an object of strings", lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
    "config": ("null or an object of integers", lambda v: v is None or isinstance(v, dict) and all(
        isinstance(x, int) for x in v.values())),
    "window_ms": ("an object of [p20, p80] pairs of numbers", lambda v: isinstance(v, dict) and all(
        isinstance(x, list) and len(x) == 2 and all(_number(y) for y in x) for x in v.values())),
    "rounds": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "unstable": ("a boolean", lambda v: isinstance(v, bool)),
    "measured": ("null or a string", lambda v: v is None or isinstance(v, str)),
    "shape": ("an object", lambda v: isinstance(v, dict)),
}


def record_problem(record) -> str | None:
    """Why ``record`` is not a record the tuner can use (None when it is): a dict with a str
    "choice", and, where present, the tuner's fields with values of the right types."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    if not isinstance(record.get("choice"), str):
        return "no string 'choice'"
    for name, (what, ok) in _FIELDS.items():
        if name in record and not ok(record[name]):
            return f"'{name}' is not {what}"
    return None


class TuneStore:
    """Tuning records of one device model, backed by ``store_path(device_name, directory)``.

    ``get``/``put``/``entries`` hand out and take copies, so callers cannot change the store by
    mutating a record. The file is read at the first ``get``/``put``, not at construction.
    """

    def __init__(self, device_name: str, directory: str | os.PathLike | None = None):
        self.device_name = device_name
        self.path = store_path(device_name, directory)
        self._entries: dict[str, dict] | None = None  # None until loaded
        self._own: set[str] = set()  # keys put here: they win over the file's on merge
        self._versions: dict | None = None
        self._file_warned = False
        self._write_warned = False
        self._mutex = threading.Lock()  # the file lock does not guard our own dict

    def __repr__(self) -> str:
        return f"TuneStore({self.device_name!r}, path={str(self.path)!r})"

    # ------------------------------------------------------------------ public API

    def get(self, key: str) -> dict | None:
        """The record stored under ``key`` (a copy), or ``None`` when nothing is stored."""
        with self._mutex:
            record = self._loaded().get(key)
            return _copy(record) if record is not None else None

    def entries(self) -> dict:
        """A copy of all records, ``{key: record}``."""
        with self._mutex:
            return _copy(self._loaded())

    def put(self, key: str, record: dict) -> None:
        """Store ``record`` under ``key`` and write the file at once (merged with what other
        processes wrote meanwhile; on the same key, this record wins). A write failure only
        warns: the record stays available from this store.
        """
        if not isinstance(key, str):
            raise TypeError(f"TuneStore.put: key must be a str, got {type(key).__name__}")
        problem = record_problem(record)
        if problem is not None:
            raise ValueError(
                f"TuneStore.put({key!r}): record must be a dict with a str 'choice' (the chosen "
                f"strategy) and well-typed fields; this one is {problem}: {record!r}"
            )
        try:
            record = _copy(record)  # JSON round trip: memory holds exactly what a reload gives
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"TuneStore.put({key!r}): record is not JSON-serialisable ({e}); store plain "
                "str/int/float/bool/None/list/dict values (e.g. float(t) for a tensor)"
            ) from None
        with self._mutex:
            self._loaded()[key] = record
            self._own.add(key)
            self._write()

    # ------------------------------------------------------------------ loading

    def _loaded(self) -> dict:
        if self._entries is None:
            self._versions = versions()
            entries, problem = self._read()
            if problem is not None:
                self._warn_file(problem)
            self._entries = entries or {}
        return self._entries

    def _read(self) -> tuple[dict | None, str | None]:
        """The file's valid entries and why any were ignored: (entries, None) when all is
        well, (None, reason) when the whole file is unusable, (entries, reason) when some
        entries were malformed. A missing file is (None, None)."""
        try:
            raw = self.path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # no file yet; a bad dir shows on write
            return None, None
        except OSError as e:
            return None, f"cannot read it ({type(e).__name__}: {e})"
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError too
            return None, f"not valid JSON ({type(e).__name__}: {e})"
        if not isinstance(data, dict):
            return None, f"top level is a JSON {type(data).__name__}, not an object"
        if data.get("schema") != SCHEMA_VERSION:
            return None, f"schema {data.get('schema')!r}; this dpgrad reads schema {SCHEMA_VERSION}"
        if data.get("device") != self.device_name:
            return None, f"written for device {data.get('device')!r}; this is {self.device_name!r}"
        theirs = data.get("versions")
        if not isinstance(theirs, dict):
            return None, "no 'versions' object"
        for name, ours in self._versions.items():
            if theirs.get(name) != ours:
                return None, f"written by {name} {theirs.get(name)}; this is {ours}"
        entries = data.get("entries")
        if not isinstance(entries, dict):
            return None, f"'entries' is a JSON {type(entries).__name__}, not an object"
        bad = {k: record_problem(v) for k, v in entries.items()}
        bad = {k: why for k, why in bad.items() if why is not None}
        if bad:
            entries = {k: v for k, v in entries.items() if k not in bad}
            key, why = next(iter(bad.items()))
            return entries, f"dropped {len(bad)} malformed entries, e.g. {key!r} ({why})"
        return entries, None

    # ------------------------------------------------------------------ writing

    def _write(self) -> None:
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with _exclusive_lock(self.path.with_name(self.path.name + ".lock")):
                # Re-read under the lock: another process may have written since we loaded.
                # Its entries supersede the ones we loaded earlier; our own puts win over both.
                theirs, problem = self._read()
                if problem is not None:  # e.g. another torch version wrote it since we loaded
                    self._warn_file(problem)
                merged = dict(self._entries)
                merged.update(theirs or {})
                merged.update({k: self._entries[k] for k in self._own})
                self._entries = merged
                if fcntl is not None:  # under the lock no other writer is at work
                    _remove_leftovers(self.path)
                _atomic_write_json(self.path, self._document())
        except OSError as e:
            if not self._write_warned:
                self._write_warned = True
                warnings.warn(
                    f"dpgrad tuning store {self.path}: cannot write it ({type(e).__name__}: {e}); "
                    "tuning results are kept in memory for this run only. Set DPGRAD_TUNE_DIR "
                    "to a writable directory to keep them.",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _document(self) -> dict:
        return {
            "schema": SCHEMA_VERSION,
            "device": self.device_name,
            "versions": self._versions,
            "entries": self._entries,
        }

    def _warn_file(self, reason: str) -> None:
        if not self._file_warned:
            self._file_warned = True
            warnings.warn(
                f"dpgrad tuning store {self.path}: {reason}: ignoring it and retuning",
                RuntimeWarning,
                stacklevel=4,
            )


def _copy(obj):
    return json.loads(json.dumps(obj))


class _exclusive_lock:
    """``flock`` on a sibling lock file (never deleted: deleting it would let two processes
    hold locks on different inodes). Without fcntl, no lock: writes stay atomic, but two
    simultaneous writers may drop each other's new entries (they are then just retuned)."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.fd = None

    def __enter__(self):
        if fcntl is not None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(self.fd)
                raise
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # closing releases the flock
        return False


def _remove_leftovers(path: pathlib.Path) -> None:
    """Delete the temporary files of writers of ``path`` that were killed before renaming
    theirs (``_atomic_write_json``'s): called under the lock, when no writer is at work."""
    for leftover in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        try:
            leftover.unlink()
        except OSError:
            pass


def _atomic_write_json(path: pathlib.Path, document: dict) -> None:
    # Readers never take the lock, so they must never see a half-written file: write a temp file
    # in the same directory (same file system, so os.replace is atomic), fsync it, then rename.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache may be shared within a group
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
