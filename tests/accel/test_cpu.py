import os
import subprocess
import sys

import torch

from glassformer.accel import cpu, ops

ZEN4 = ("model name\t: AMD EPYC 9R14\nflags\t\t: fpu sse avx fma avx2 avx512f avx512bw "
        "avx512_bf16 avx512_vnni\n")
ZEN3 = "model name\t: AMD EPYC 7R13\nflags\t\t: fpu sse avx fma avx2\n"
SAPPHIRE = ("model name\t: Intel Xeon 8488C\nflags\t\t: avx fma avx2 avx512f avx512_bf16 "
            "avx512_vnni amx_bf16 amx_tile avx_vnni\n")


def test_features_are_read_from_the_flags():
    zen4 = cpu.parse(ZEN4, "AVX512")
    assert zen4.model == "AMD EPYC 9R14"
    assert (zen4.avx2, zen4.avx512, zen4.avx512_bf16, zen4.vnni, zen4.amx) == (
        True, True, True, True, False)
    zen3 = cpu.parse(ZEN3, "AVX2")
    assert (zen3.avx2, zen3.fma, zen3.avx512, zen3.bf16_arithmetic, zen3.vnni) == (
        True, True, False, False, False)
    assert cpu.parse(SAPPHIRE, "AVX512").amx


def test_avx512_that_pytorch_does_not_dispatch_to_counts_as_absent():
    capped = cpu.parse(ZEN4, "AVX2")  # ATEN_CPU_CAPABILITY=avx2 on a Zen 4
    assert capped.avx2 and not (capped.avx512 or capped.avx512_bf16 or capped.vnni)
    assert not cpu.parse(ZEN4, "DEFAULT").avx2


def test_summary_names_every_deciding_feature():
    line = cpu.parse(ZEN3, "AVX2").summary()
    assert line == "AMD EPYC 7R13: AVX2 yes, AVX-512 no, AVX-512 BF16 no, AMX no, VNNI no"


def test_a_generic_model_name_gets_the_family_and_model_numbers():
    text = ("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
            "flags\t\t: fpu avx2 fma\n\nprocessor\t: 1\ncpu family\t: 99\nmodel\t\t: 7\n")
    features = cpu.parse(text, "AVX2")
    assert features.model == "AMD EPYC (family 25, model 1)"  # the first processor's
    assert features.avx2 and features.fma


def test_the_cpu_is_named_by_its_model_and_flags(monkeypatch):
    monkeypatch.setattr(cpu, "cpuinfo_text", lambda: ZEN4)
    zen4 = cpu.cpu_identity()
    monkeypatch.setattr(cpu, "cpuinfo_text", lambda: ZEN3)
    assert "AMD EPYC 9R14" in zen4 and "avx512_bf16" in zen4 and cpu.cpu_identity() != zen4


def test_this_machine_is_described():
    features = cpu.cpu_features()
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        assert not (features.avx512 or features.avx512_bf16 or features.amx)
    assert features.summary().startswith(features.model)


def test_bf16_prefill_never_rounds_the_activations():
    x, w = torch.randn(16, 64), torch.randn(32, 64)  # 16 rows: past the C++ kernels' tile
    y = ops.linear_bf16(x, w.bfloat16(), None, "auto")
    torch.testing.assert_close(y, x @ w.bfloat16().float().T, rtol=1e-5, atol=1e-5)


def test_a_lowered_dispatch_loads_the_avx2_kernels():
    """ATEN_CPU_CAPABILITY=avx2 in a real process: on a CPU with AVX-512 the library's kernels
    are the AVX2 build; elsewhere the native one."""
    code = ("import torch; from glassformer.accel import build, decisions, kernels\n"
            "target = decisions.kernel_target().choice\n"
            "print(target, kernels.extension() is build.extension(target))")
    env = {name: value for name, value in os.environ.items() if name != "GLASSFORMER_KERNEL_TARGET"}
    env["ATEN_CPU_CAPABILITY"] = "avx2"  # the choice left to the process, as a user's is
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=600, check=True)
    expected = "avx2" if cpu.parse(cpu.cpuinfo_text(), "AVX512").avx512 else "native"
    assert done.stdout.split() == [expected, "True"]
