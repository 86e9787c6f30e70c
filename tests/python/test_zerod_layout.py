"""The Python package's ctypes mirror of zerod.h (zerod/_lib.py, and the
enum values client.py and errors.py use) against the header itself: a
small C program, compiled here against client/include/zerod.h, prints
every struct's size and the offset of every field the mirror declares, and
every enum value; each must be the mirror's. A copy of the header with two
fields swapped must make the comparison fail, so it cannot pass by
accident."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest

from zerod import _config, _lib, _lifetime, client, errors

HEADER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client",
                          "include")

# Every struct of zerod.h that crosses the API, and its mirror.
STRUCTS = {
    "zd_job_config": _lib.JobConfig,
    "zd_attach_options": _lib.AttachOptions,
    "zd_tensor_desc": _lib.TensorDesc,
    "zd_unit_desc": _lib.UnitDesc,
    "zd_tensor_view": _lib.TensorView,
    "zd_view": _lib.View,
    "zd_step_options": _lib.StepOptions,
    "zd_step_result": _lib.StepResult,
    "zd_unit_info": _lib.UnitInfo,
    "zd_pending": _lib.Pending,
    "zd_collective_counter": _lib.CollectiveCounter,
    "zd_rank_stats": _lib.RankStats,
    "zd_param_group": _lib.ParamGroup,
    "zd_checkpoint_info": _lib.CheckpointInfo,
    "zd_update": _lib.Update,
    "zd_delta": _lib.Delta,
}

# Every enum value and constant the package uses, by its name in zerod.h.
CONSTANTS = {
    "ZD_F32": _lib.F32, "ZD_BF16": _lib.BF16, "ZD_F16": _lib.F16,
    "ZD_ADAMW": _lib.ADAMW, "ZD_ADAM": _lib.ADAM, "ZD_SGD": _lib.SGD,
    "ZD_INIT_FROM_RANK0": _lib.INIT_FROM_RANK0, "ZD_INIT_SEEDED_NORMAL": _lib.INIT_SEEDED_NORMAL,
    "ZD_INIT_ZEROS": _lib.INIT_ZEROS,
    "ZD_COLLECTIVES_HIERARCHICAL": _config._COLLECTIVES["hierarchical"],
    "ZD_COLLECTIVES_FLAT": _config._COLLECTIVES["flat"],
    "ZD_OFFLOAD_NONE": _config._OFFLOAD_DEVICES["none"],
    "ZD_OFFLOAD_CPU": _config._OFFLOAD_DEVICES["cpu"],
    "ZD_OFFLOAD_NVME": _config._OFFLOAD_DEVICES["nvme"],
    "ZD_ATTACH_EXISTING": _lifetime.ATTACH_EXISTING,
    "ZD_CREATE_OR_RESUME": _lifetime.CREATE_OR_RESUME,
    "ZD_CREATE_FRESH": _lifetime.CREATE_FRESH,
    "ZD_STATE_WEIGHTS": client._STATES["weights"],
    "ZD_STATE_MOMENT1": client._STATES["exp_avg"],
    "ZD_STATE_MOMENT2": client._STATES["exp_avg_sq"],
    "ZD_MAX_COLLECTIVE_COUNTERS": _lib.MAX_COLLECTIVE_COUNTERS,
}
for _code, _cls in errors.BY_STATUS.items():
    CONSTANTS["ZD_E_" + re.sub(r"(?<!^)([A-Z])", r"_\1",
                               _cls.__name__.rstrip("_").replace("Error", "")).upper()] = _code
CONSTANTS["ZD_E_NOMEM"] = CONSTANTS.pop("ZD_E_NO_MEMORY")
CONSTANTS["ZD_E_IO"] = CONSTANTS.pop("ZD_E_I_O")


def c_program() -> str:
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "zerod.h"', "int main(void) {"]
    for c_name, mirror in STRUCTS.items():
        lines.append('  printf("%s %%zu\\n", sizeof(%s));' % (c_name, c_name))
        for field, _ in mirror._fields_:
            lines.append('  printf("%s.%s %%zu\\n", offsetof(%s, %s));' %
                         (c_name, field, c_name, field))
    for name in CONSTANTS:
        lines.append('  printf("%s %%lld\\n", (long long)(%s));' % (name, name))
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


def header_facts(tmp_path, include_dir: str) -> dict:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    source = tmp_path / "layout.c"
    source.write_text(c_program())
    exe = tmp_path / "layout"
    built = subprocess.run([cc, "-std=c11", "-I", include_dir, str(source), "-o", str(exe)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {key: int(value) for key, value in (line.split() for line in out.splitlines())}


def mirror_facts() -> dict:
    facts = {}
    for c_name, mirror in STRUCTS.items():
        facts[c_name] = ctypes.sizeof(mirror)
        for field, _ in mirror._fields_:
            facts["%s.%s" % (c_name, field)] = getattr(mirror, field).offset
    facts.update(CONSTANTS)
    return facts


def differences(header: dict, mirror: dict) -> list:
    return sorted("%s: zerod.h %s, Python %s" % (k, header.get(k), mirror.get(k))
                  for k in set(header) | set(mirror) if header.get(k) != mirror.get(k))


def test_every_struct_of_the_header_is_mirrored():
    text = open(os.path.join(HEADER_DIR, "zerod.h")).read()
    declared = set(re.findall(r"typedef struct (zd_\w+) \{", text))
    assert declared == set(STRUCTS), declared ^ set(STRUCTS)


def test_the_mirror_has_the_headers_sizes_offsets_and_values(tmp_path):
    assert differences(header_facts(tmp_path, HEADER_DIR), mirror_facts()) == []


def test_a_field_moved_in_the_header_is_caught(tmp_path):
    """zerod.h with zd_step_result's grad_norm and version swapped: the
    comparison names both."""
    text = open(os.path.join(HEADER_DIR, "zerod.h")).read()
    start = text.index("typedef struct zd_step_result {")
    end = text.index("} zd_step_result;", start)
    body = text[start:end]
    version = re.search(r"\n  uint64_t version;[^\n]*", body).group(0)
    norm = re.search(r"\n  double grad_norm;[^\n]*", body).group(0)
    swapped = body.replace(version, "\0").replace(norm, version).replace("\0", norm)
    assert swapped != body
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "zerod.h").write_text(text[:start] + swapped + text[end:])
    found = differences(header_facts(tmp_path, str(moved)), mirror_facts())
    assert any(d.startswith("zd_step_result.version:") for d in found), found
    assert any(d.startswith("zd_step_result.grad_norm:") for d in found), found
