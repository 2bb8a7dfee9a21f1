"""How the engine builds its C kernels: the headers beside them on the include path and in the build's name, and the
one C struct of a packed weight that the Python side mirrors."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

from support.cpus import fake_build, fresh_process

from npumoe.engine.kernels import int_linear, native
from npumoe.engine.kernels.int_linear import HEADER, NativeWeight

KERNELS = Path(native.__file__).parent


def test_a_header_edit_builds_the_kernel_again_with_its_folder_on_the_include_path(tmp_path, monkeypatch):
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "probe.c").write_text('#include "shared.h"\nint probe(void) { return ANSWER; }\n')
    header = sources / "shared.h"
    header.write_text("#define ANSWER 1\n")
    monkeypatch.setattr(native, "__file__", str(sources / "native.py"))  # where kernels' sources are looked for
    kernel = native.NativeKernel("probe", "the probe kernel", {"probe": ()}, lambda: None, headers=("shared.h",))
    fresh_process(monkeypatch, tmp_path / "cache")
    build = fake_build(monkeypatch, tmp_path)

    assert kernel.unavailable() is None
    fresh_process(monkeypatch)
    assert kernel.unavailable() is None  # a new process finds it built
    header.write_text("#define ANSWER 2\n")
    fresh_process(monkeypatch)
    assert kernel.unavailable() is None

    assert len(build.runs) == 2 and all(f"-I {sources} " in run for run in build.runs)
    first, _, second = (path.name for path, _ in build.loaded)
    assert first != second and first.startswith("probe-") and second.startswith("probe-")


def test_the_int_kernels_read_the_one_header_and_no_source_defines_the_weight_struct_again():
    for name in ("vnni_linear", "avx2_linear", "neon_linear"):
        source = (KERNELS / f"{name}.c").read_text()
        assert f'#include "{HEADER}"' in source and "struct npumoe_weight {" not in source, name
    assert (KERNELS / HEADER).read_text().count("struct npumoe_weight {") == 1


def test_the_ctypes_weight_has_the_header_structs_fields_in_its_order():
    body = re.search(r"struct npumoe_weight \{(.*?)\};", (KERNELS / HEADER).read_text(), re.DOTALL).group(1)
    declared = []
    for declaration in filter(str.strip, body.split(";")):  # "const void *codes, *sums, ..." or "int64_t group, ..."
        words = re.findall(r"\*?\w+", declaration)
        if "*" in declaration:
            declared += [(word.lstrip("*"), ctypes.c_void_p) for word in words if word.startswith("*")]
        else:
            declared += [(word, ctypes.c_int64) for word in words[1:]]
    assert len(declared) == 7 and NativeWeight._fields_ == declared
    assert int_linear.native_kernel("vnni_linear", "a kernel", lambda: None).headers == (HEADER,)
