"""Every benchmark result JSON names its host: CPU model, vector extensions, cores and the
library versions (issue 33: the same code is 2x apart on two hosts of one core count)."""

import json
import os

from benchmarks import host_info, results

# Two processors of an AVX-512/AMX Xeon as /proc/cpuinfo lists them (flags abridged); the
# second one's model must not override the first's.
XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: something else
flags\t\t: fpu
"""
EPYC = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n"


def test_cpu_model_and_vector_extensions_come_from_the_first_processor():
    assert host_info.cpu_description(XEON) == {
        "cpu_model": "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
        "vector_extensions": ["avx2", "avx512f", "amx_tile"],
    }
    assert host_info.cpu_description(EPYC) == {
        "cpu_model": "AMD EPYC",
        "vector_extensions": ["avx2"],
    }


def test_every_json_result_carries_the_host(tmp_path, capsys):
    path = results.write_json("demo", {"x": 1}, str(tmp_path / "r.json"))
    host = json.loads(path.read_text())["host"]
    assert host["cpu_count"] == os.cpu_count()
    assert host["affinity_cores"] == len(os.sched_getaffinity(0))
    assert set(host["versions"]) == {"jax", "jaxlib", "torch", "transformers"}
    assert host["versions"]["jax"]  # installed here; a missing library is null
    assert host_info.library_version("no-such-package-jaxmoe") is None
    results.write_json("demo", {"x": 2}, "-")  # stdout's JSON line has it too
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["host"] == host
    kept = {"x": 3, "host": {"cpu_model": "measured elsewhere"}}  # a result's own host stays
    assert json.loads(results.write_json("d", kept, str(tmp_path / "k.json")).read_text()) == kept
