"""jaxmoe.storage.mirror: what is copied to the remote folder, and when (both folders local here;
tests/test_gcs.py runs it against a GCS API server)."""

import os

from jaxmoe.storage.mirror import Mirror


def listing(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_push_changed_copies_replaced_and_in_place_files_and_deletes_gone_ones(tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    remote.mkdir()
    (remote / "old.npy").write_bytes(b"old")
    (remote / "kept.json").write_bytes(b"k1")
    mirror = Mirror(str(remote), str(local))
    mirror.pull_all()
    assert listing(local) == {"kept.json": b"k1", "old.npy": b"old"}

    (local / "old.npy").unlink()  # garbage-collected locally
    (local / "new.npy").write_bytes(b"new")
    (local / "half.npy.tmp").write_bytes(b"partial")  # being written: never copied
    (remote / "kept.json").write_bytes(b"remote edit")  # untouched locally: not copied again
    with open(local / "log.npy", "wb") as f:
        f.write(b"aaaa")
    mirror.push_changed()
    stat = os.stat(local / "log.npy")
    with open(local / "log.npy", "r+b") as f:  # same size; mtime restored as a memmap may
        f.write(b"bb")
    os.utime(local / "log.npy", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    mirror.push_changed(updated_in_place=("log.npy",))

    assert listing(remote) == {"kept.json": b"remote edit", "log.npy": b"bbaa", "new.npy": b"new"}


def test_pull_of_a_missing_file_is_false_and_leaves_nothing(tmp_path):
    mirror = Mirror(str(tmp_path / "remote"), str(tmp_path / "local"))
    assert not mirror.pull("absent.npy")
    assert not (tmp_path / "local").exists()
