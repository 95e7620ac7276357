"""Fetch, on a machine with network, the wheels an offline GPU image lacks for jaxmoe's run.

    python3.12 benchmarks/gpu/fetch_wheels.py --out gpu_bundle
        [--python 3.12] [--platform manylinux_2_28_x86_64] [--image-freeze freeze.txt]
        [--extras data] [--max_mib 60]

The target image (default: the H200 image, Python 3.12 on manylinux x86_64) already holds
IMAGE below and their dependencies. The image's packages are resolved first (from
`--image-freeze`, `pip freeze` run on the image, when given: exact), then jaxmoe's own
requirements with the image's versions as constraints; what the second resolution adds is
downloaded (`pip download --no-deps --only-binary=:all:` for the target), next to a wheel of
this checkout's jaxmoe, run.sh and oneshot.py, and manifest.json (each file's name, version,
size and sha256; the target; the image assumed; what is left out on purpose). The folder
must stay under --max_mib: it is what travels to the GPU machine.

Run it with pip >= 24 (older pip checks Requires-Python against the running interpreter
rather than --python): a Python 3.12 venv's pip does.
"""

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
IMAGE = (
    "jax==0.11.2",
    "jaxlib==0.11.2",
    "flax",
    "optax",
    "orbax-checkpoint",
    "tensorstore",
    "sentencepiece",
    "tokenizers",
    "torch",
    "transformers",
)
# jaxmoe requirements the GPU run never imports (parquet sources, routing plots): left out,
# so the folder stays small; `jaxmoe` then imports everything but those two paths.
LEAVE_OUT = ("pyarrow", "matplotlib")
GLIBC_TAGS = ("2_28", "2_27", "2_17")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def target_flags(python: str, platform: str) -> list[str]:
    """pip's flags selecting wheels for the target interpreter and platform."""
    abi = "cp" + python.replace(".", "")
    flags = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    flags += ["--abi", abi, "--abi", "abi3", "--abi", "none"]
    platforms = [platform]
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", platform)
    if match:  # an image with glibc 2.28 also runs wheels built for older glibc
        major, minor, arch = int(match[1]), int(match[2]), match[3]
        for tag in GLIBC_TAGS:
            a, b = map(int, tag.split("_"))
            if (a, b) <= (major, minor):
                platforms.append(f"manylinux_{tag}_{arch}")
        platforms.append(f"manylinux2014_{arch}")
    for tag in dict.fromkeys(platforms):
        flags += ["--platform", tag]
    return flags


def pip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", *args]
    run = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    if check and run.returncode:
        sys.stderr.write(run.stderr)
        raise SystemExit(f"fetch_wheels: pip {args[0]} failed (above)")
    return run


def resolve(requirements, flags, constraints: Path | None, work: Path, built: Path):
    """canonical name -> version that pip would install for `requirements` on the target.

    A requirement published only as an sdist (tensorflow-datasets' `promise`) cannot be
    resolved for another platform; it is built here into `built` (a pure-Python wheel fits
    any target, anything else is refused) and the resolution retried with it."""
    extra = ["-c", str(constraints)] if constraints else []
    for _ in range(10):
        report = work / f"report-{len(list(work.glob('report-*')))}.json"
        run = pip(
            "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
            "--target", str(work / "unused"), "--find-links", str(built), *flags, *extra,
            *requirements, check=False,
        )  # fmt: skip
        if run.returncode == 0:
            items = json.loads(report.read_text())["install"]
            return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
        lacking = re.search(r"No matching distribution found for ([A-Za-z0-9_.\-]+)", run.stderr)
        if not lacking:
            sys.stderr.write(run.stderr)
            raise SystemExit("fetch_wheels: the resolution failed (above)")
        name = lacking[1]
        pip("wheel", "--quiet", "--no-deps", "--no-binary", name, "-w", str(built), name)
        if not any(
            canonical(p.name).startswith(canonical(name)) for p in built.glob("*none-any.whl")
        ):
            raise SystemExit(f"fetch_wheels: {name} has no wheel for the target and is not pure")
    raise SystemExit("fetch_wheels: gave up after 10 packages without a wheel")


def image_packages(freeze: Path | None, flags, work: Path, built: Path) -> dict[str, str]:
    if freeze is None:
        return resolve(IMAGE, flags, None, work, built)
    found = {}
    for line in freeze.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not name.startswith("#"):
            found[canonical(name)] = version
    return found


def jaxmoe_requirements(wheel: Path, extras: list[str]) -> list[str]:
    """The wheel's Requires-Dist for the run: core ones plus `extras`, minus LEAVE_OUT."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(meta).decode()
    wanted = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement, _, marker = line.removeprefix("Requires-Dist:").strip().partition(";")
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        if extra and extra[1] not in extras:
            continue
        name = canonical(re.split(r"[\s<>=!~\[;(]", requirement, maxsplit=1)[0])
        if name in map(canonical, LEAVE_OUT) or name == "jaxmoe":
            continue
        wanted.append(requirement.strip())
    return wanted


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="the folder to write")
    parser.add_argument("--python", default="3.12", help="the image's Python version")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64", help="its platform tag")
    parser.add_argument("--image-freeze", type=Path, default=None, help="`pip freeze` of it")
    parser.add_argument("--extras", default="", help="jaxmoe extras to add, e.g. data")
    parser.add_argument("--max_mib", type=float, default=60.0)
    args = parser.parse_args(argv)
    extras = [e for e in args.extras.split(",") if e]
    flags = target_flags(args.python, args.platform)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="fetch-wheels-") as tmp:
        work = Path(tmp)
        pip("wheel", "--quiet", "--no-deps", "-w", str(args.out), str(ROOT))
        (wheel,) = args.out.glob("jaxmoe-*.whl")
        built = work / "built"
        built.mkdir()
        image = image_packages(args.image_freeze, flags, work, built)
        constraints = work / "image-constraints.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(image.items())))
        needed = resolve(jaxmoe_requirements(wheel, extras), flags, constraints, work, built)
        missing = {n: v for n, v in needed.items() if n not in image}
        local = {canonical(p.name.split("-")[0]): p for p in built.glob("*.whl")}
        for name in [n for n in missing if n in local]:
            shutil.copy2(local.pop(name), args.out)
            del missing[name]
        if missing:
            specs = [f"{n}=={v}" for n, v in sorted(missing.items())]
            pip("download", "--quiet", "--no-deps", *flags, "-d", str(args.out), *specs)
    for script in ("run.sh", "oneshot.py"):
        shutil.copy2(HERE / script, args.out / script)
    files = sorted(args.out.iterdir())
    total = sum(p.stat().st_size for p in files)
    manifest = {
        "target": {"python": args.python, "platform": args.platform},
        "image": args.image_freeze.name if args.image_freeze else list(IMAGE),
        "image_resolved": image,
        "extras": extras,
        "left_out": list(LEAVE_OUT),
        "wheels": [
            {"file": p.name, "bytes": p.stat().st_size, "sha256": sha256(p)}
            for p in files
            if p.suffix == ".whl"
        ],
        "total_mib": round(total / 2**20, 2),
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{args.out}: {len(manifest['wheels'])} wheels, {manifest['total_mib']} MiB")
    for entry in manifest["wheels"]:
        print(f"  {entry['file']}  {entry['bytes'] / 2**20:.2f} MiB")
    if total > args.max_mib * 2**20:
        print(f"fetch_wheels: {total / 2**20:.1f} MiB is over --max_mib {args.max_mib}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
