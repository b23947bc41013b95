"""The autotuner's per-GPU store: round trip, where it lives, and that it never crashes a run.

A bad or stale file is ignored with exactly one RuntimeWarning and then rewritten; an
unwritable directory warns once and the store works in memory; processes writing at once all
keep their entries (lock + re-read + merge). CPU only, no Triton import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import dpgrad
from dpgrad.tuning import store as tune_store
from dpgrad.tuning.store import SCHEMA_VERSION, TuneStore, default_dir, store_path, versions

DEVICE = "NVIDIA H100 80GB HBM3"
RECORD = {
    "choice": "direct",
    "timings_ms": {"direct": 0.12, "gram": 0.31},
    "config": {"BLOCK_K": 64},
    "measured": "2026-11-21T10:00:00Z",
}


def _document(**overrides) -> dict:
    """A valid store file for DEVICE at the current versions, with fields overridden."""
    doc = {
        "schema": SCHEMA_VERSION,
        "device": DEVICE,
        "versions": versions(),
        "entries": {"old": dict(RECORD, choice="gram")},
    }
    doc.update(overrides)
    return doc


class _Warnings:
    """Records every warning (the default filter would hide repeats, which we must count)."""

    def __enter__(self):
        self._cm = warnings.catch_warnings(record=True)
        self.caught = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    @property
    def runtime(self) -> list[str]:
        return [str(w.message) for w in self.caught if issubclass(w.category, RuntimeWarning)]


def _assert_valid_file(path, keys) -> dict:
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA_VERSION
    assert data["device"] == DEVICE
    assert data["versions"] == versions()
    assert set(data["entries"]) == set(keys)
    return data


# ---------------------------------------------------------------------------- location


@pytest.mark.parametrize(
    "name, slug",
    [
        ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
        ("NVIDIA A100-SXM4-40GB", "nvidia-a100-sxm4-40gb"),
        ("AMD Instinct MI300X", "amd-instinct-mi300x"),
        ("cpu-Intel(R) Xeon(R) Platinum 8480+", "cpu-intel-r-xeon-r-platinum-8480"),
        ("../../etc/passwd", "etc-passwd"),
        ("", "unknown-device"),
    ],
)
def test_store_path_is_a_slug_of_the_device_name(tmp_path, name, slug):
    assert store_path(name, tmp_path) == tmp_path / f"{slug}.json"


def test_long_device_names_are_shortened_and_kept_apart(tmp_path):
    a, b = store_path("x" * 300 + "a", tmp_path), store_path("x" * 300 + "b", tmp_path)
    assert a != b and a.parent == tmp_path and len(a.name) <= 90


def test_default_dir_env_override_xdg_and_home(tmp_path, monkeypatch):
    monkeypatch.delenv("DPGRAD_TUNE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_dir() == tmp_path / "home" / ".cache" / "dpgrad" / "tune"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_dir() == tmp_path / "xdg" / "dpgrad" / "tune"
    # Read when the store is built, not when the module was imported.
    monkeypatch.setenv("DPGRAD_TUNE_DIR", str(tmp_path / "override"))
    assert default_dir() == tmp_path / "override"
    assert TuneStore(DEVICE).path == tmp_path / "override" / "nvidia-h100-80gb-hbm3.json"
    assert TuneStore(DEVICE, tmp_path / "explicit").path.parent == tmp_path / "explicit"


def test_cpu_device_name_is_stable():
    name = tune_store.device_name(torch.device("cpu"))
    assert name.startswith("cpu-") and len(name) > 4
    assert tune_store.device_name("cpu") == name


# One fresh interpreter holds the checks that need one (each prints a line of its own): what
# importing the store and reading the versions imports; then processes writing at once,
# forked from it after those imports (the interpreter has run nothing else, so forking is
# safe), each with its own store and file descriptors.
FRESH = textwrap.dedent("""
    import json, multiprocessing, sys
    import dpgrad.tuning.store as s

    v = s.versions()
    print(json.dumps({"versions": sorted(v), "triton_imported": "triton" in sys.modules}), flush=True)

    directory, device, record, n_procs, n_keys = json.loads(sys.argv[1])

    def put_many(prefix, barrier):
        store = s.TuneStore(device, directory)
        store.get("load-now")  # every process starts from the same (empty) file
        barrier.wait()
        for i in range(n_keys):
            store.put(f"{prefix}-{i}", dict(record, config={"i": i}))

    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(n_procs)
    procs = [ctx.Process(target=put_many, args=(f"p{p}", barrier)) for p in range(n_procs)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    print(json.dumps({"exitcodes": [proc.exitcode for proc in procs]}), flush=True)
""")
N_PROCS, N_KEYS = 3, 50


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """(the fresh interpreter's process, its output lines, the writers' store directory)."""
    directory = tmp_path_factory.mktemp("writers")
    args = json.dumps([str(directory), DEVICE, RECORD, N_PROCS, N_KEYS])
    proc = subprocess.run([sys.executable, "-c", FRESH, args], capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, lines, directory


@pytest.mark.xdist_group("test_tuning_store")  # the tests of the fresh interpreter share it
def test_versions_do_not_import_triton(fresh):
    proc, lines, _ = fresh
    assert lines and "versions" in lines[0], proc.stderr[-3000:]
    assert lines[0]["triton_imported"] is False, "triton imported"
    assert lines[0]["versions"] == ["dpgrad", "torch", "triton"]
    v = versions()
    assert v["dpgrad"] == dpgrad.__version__ and v["torch"] == torch.__version__


# ---------------------------------------------------------------------------- round trip


def test_round_trip(tmp_path):
    with _Warnings() as w:
        store = TuneStore(DEVICE, tmp_path / "new" / "dir")  # created on first put
        assert store.get("k") is None
        store.put("k", RECORD)
        store.put("k2", dict(RECORD, choice="gram"))
        again = TuneStore(DEVICE, tmp_path / "new" / "dir")
        assert again.get("k") == RECORD
        assert again.entries() == {"k": RECORD, "k2": dict(RECORD, choice="gram")}
    assert w.runtime == []
    _assert_valid_file(store.path, {"k", "k2"})
    assert sorted(p.name for p in store.path.parent.iterdir()) == [
        store.path.name,
        store.path.name + ".lock",
    ]  # no temp files left behind


def test_records_are_copies_and_bad_records_are_refused(tmp_path):
    store = TuneStore(DEVICE, tmp_path)
    record = json.loads(json.dumps(RECORD))
    store.put("k", record)
    record["choice"] = "changed"
    store.get("k")["choice"] = "changed"
    store.entries()["k"]["choice"] = "changed"
    assert store.get("k") == RECORD
    with pytest.raises(ValueError, match="str 'choice'"):
        store.put("k", {"timings_ms": {}})
    with pytest.raises(ValueError, match="str 'choice'"):
        store.put("k", ["direct"])
    with pytest.raises(ValueError, match="'skipped' is not an object of strings"):
        store.put("k", dict(RECORD, skipped=["gram"]))
    with pytest.raises(TypeError, match="JSON-serialisable"):
        store.put("k", {"choice": "direct", "t": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="key must be a str"):
        store.put(("k",), RECORD)
    assert store.entries() == {"k": RECORD}


def test_file_is_read_lazily(tmp_path):
    store = TuneStore(DEVICE, tmp_path)
    store.path.write_text(json.dumps(_document()))  # written after construction: still seen
    assert store.get("old")["choice"] == "gram"


def test_two_stores_in_one_process_merge_and_own_puts_win(tmp_path):
    a, b = TuneStore(DEVICE, tmp_path), TuneStore(DEVICE, tmp_path)
    a.put("shared", dict(RECORD, choice="a"))
    b.get("anything")  # b loaded before a's next write: its put must still keep a's key
    a.put("only_a", RECORD)
    b.put("shared", dict(RECORD, choice="b"))
    data = _assert_valid_file(a.path, {"shared", "only_a"})
    assert data["entries"]["shared"]["choice"] == "b"
    assert b.get("only_a") == RECORD  # b's view was refreshed by its write


# ---------------------------------------------------------------------------- bad files


@pytest.mark.parametrize(
    "content, reason, kept",
    [
        (b"\x89PNG\r\n\x1a\n\xff\xfe garbage", "not valid JSON", set()),
        (json.dumps(_document())[:-7].encode(), "not valid JSON", set()),
        (b"[1, 2, 3]", "top level is a JSON list", set()),
        (json.dumps(_document(entries=[RECORD])).encode(), "'entries' is a JSON list", set()),
        (
            json.dumps(_document(entries={"ok": RECORD, "bad": {"timings_ms": {}}})).encode(),
            "dropped 1 malformed entries",
            {"ok"},
        ),
        (
            json.dumps(_document(entries={"ok": RECORD, "bad": dict(RECORD, timings_ms={"direct": "0.1"})})).encode(),
            "dropped 1 malformed entries, e.g. 'bad' ('timings_ms' is not an object of numbers)",
            {"ok"},
        ),
        (
            json.dumps(_document(entries={"ok": RECORD, "bad": dict(RECORD, skipped=["gram"])})).encode(),
            "'skipped' is not an object of strings",
            {"ok"},
        ),
        (
            json.dumps(_document(entries={"ok": RECORD, "bad": dict(RECORD, config={"BLOCK_K": "64"}),
                                          "worse": dict(RECORD, spread=3)})).encode(),
            "dropped 2 malformed entries",
            {"ok"},
        ),
    ],
    ids=["garbage", "truncated", "list", "entries_list", "entry_without_choice", "string_timing", "list_skipped",
         "ill_typed_config_and_spread"],
)
def test_corrupt_file_warns_once_and_is_rewritten(tmp_path, content, reason, kept):
    path = store_path(DEVICE, tmp_path)
    path.write_bytes(content)
    with _Warnings() as w:
        store = TuneStore(DEVICE, tmp_path)
        assert set(store.entries()) == kept
        assert store.get("bad") is None and store.get("old") is None
        store.put("new", RECORD)
    assert len(w.runtime) == 1, w.runtime
    assert str(path) in w.runtime[0] and reason in w.runtime[0]
    _assert_valid_file(path, kept | {"new"})
    with _Warnings() as w:
        assert TuneStore(DEVICE, tmp_path).get("new") == RECORD
    assert w.runtime == []


@pytest.mark.parametrize(
    "overrides, reason",
    [
        ({"versions": dict(versions(), dpgrad="0.0.1")}, "written by dpgrad 0.0.1; this is"),
        ({"versions": dict(versions(), torch="2.12.0")}, "written by torch 2.12.0; this is"),
        ({"versions": dict(versions(), triton="0.1")}, "written by triton 0.1; this is"),
        ({"schema": SCHEMA_VERSION + 1}, f"schema {SCHEMA_VERSION + 1}; this dpgrad reads"),
        ({"device": "NVIDIA A100-SXM4-40GB"}, "written for device 'NVIDIA A100-SXM4-40GB'"),
    ],
    ids=["dpgrad", "torch", "triton", "schema", "device"],
)
def test_stale_file_is_ignored_with_the_reason_and_retuned(tmp_path, overrides, reason):
    path = store_path(DEVICE, tmp_path)
    path.write_text(json.dumps(_document(**overrides)))
    with _Warnings() as w:
        store = TuneStore(DEVICE, tmp_path)
        assert store.get("old") is None
        store.put("new", RECORD)
    assert len(w.runtime) == 1 and reason in w.runtime[0] and str(path) in w.runtime[0]
    _assert_valid_file(path, {"new"})  # rewritten at this run's versions, stale entry gone


# ---------------------------------------------------------------------------- writers


def test_temporary_files_of_a_killed_writer_are_removed(tmp_path):
    """A writer killed between writing its temporary file and renaming it leaves the file;
    the next write, under the lock, removes it."""
    store = TuneStore(DEVICE, tmp_path)
    store.put("a", RECORD)
    leftovers = [tmp_path / f".{store.path.name}.abc123.tmp", tmp_path / f".{store.path.name}.x.tmp"]
    for path in leftovers:
        path.write_text("{half a doc")
    other = tmp_path / ".another-device.json.abc.tmp"  # another store's: not ours to remove
    other.write_text("")
    TuneStore(DEVICE, tmp_path).put("b", RECORD)
    assert not any(path.exists() for path in leftovers) and other.exists()
    _assert_valid_file(store.path, {"a", "b"})


@pytest.mark.xdist_group("test_tuning_store")
def test_processes_writing_at_once_keep_all_entries(fresh):
    # Each process loaded an empty file before any wrote, so without the re-read + merge
    # under the lock the last writer's file would hold only its own keys.
    proc, lines, directory = fresh
    assert proc.returncode == 0 and len(lines) == 2, proc.stderr[-3000:]
    assert lines[1]["exitcodes"] == [0] * N_PROCS
    keys = {f"p{p}-{i}" for p in range(N_PROCS) for i in range(N_KEYS)}
    data = _assert_valid_file(store_path(DEVICE, directory), keys)
    assert data["entries"]["p1-7"]["config"] == {"i": 7}


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores permissions"
)
def test_read_only_directory_warns_once_and_keeps_results_in_memory(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    directory.chmod(0o500)
    try:
        with _Warnings() as w:
            store = TuneStore(DEVICE, directory)
            store.put("a", RECORD)
            store.put("b", RECORD)
            assert store.get("a") == RECORD and set(store.entries()) == {"a", "b"}
        assert len(w.runtime) == 1 and "cannot write" in w.runtime[0]
        assert not store.path.exists()
    finally:
        directory.chmod(0o700)


def test_directory_that_cannot_be_created_warns_once(tmp_path):
    # A regular file where the directory should be: fails even for root.
    (tmp_path / "file").write_text("")
    with _Warnings() as w:
        store = TuneStore(DEVICE, tmp_path / "file" / "tune")
        store.put("a", RECORD)
        store.put("b", RECORD)
        assert store.get("a") == RECORD and set(store.entries()) == {"a", "b"}
    assert len(w.runtime) == 1
    assert str(store.path) in w.runtime[0] and "DPGRAD_TUNE_DIR" in w.runtime[0]
