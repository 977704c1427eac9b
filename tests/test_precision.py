"""bf16 on a CPU: the trainer warns where the CPU has no bf16 instructions (each step slower
than in float32 there, docs/benchmarks/quality_3d.md), read from /proc/cpuinfo's flags."""

from __future__ import annotations

import logging

import torch

from torchtitan.parallelisms.parallelize import cpu_has_bf16, warn_if_bf16_is_slow

SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
UNKNOWN = "model name\t: some cpu\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_bf16_instructions_are_read_from_the_cpu_flags():
    assert cpu_has_bf16(SAPPHIRE_RAPIDS) is True
    assert cpu_has_bf16(GRAVITON3) is True
    assert cpu_has_bf16(SKYLAKE) is False
    assert cpu_has_bf16(UNKNOWN) is None  # no flags line: unknown


def test_only_bf16_on_a_cpu_without_bf16_instructions_is_warned(caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING):
        assert not warn_if_bf16_is_slow("float32", cpu, cpuinfo=SKYLAKE)
        assert not warn_if_bf16_is_slow("bfloat16", cuda, cpuinfo=SKYLAKE)
        assert not warn_if_bf16_is_slow("bfloat16", cpu, cpuinfo=SAPPHIRE_RAPIDS)
        assert not warn_if_bf16_is_slow("bfloat16", cpu, cpuinfo=UNKNOWN)  # no flags: no guess
        assert not caplog.records
        assert warn_if_bf16_is_slow("bfloat16", cpu, cpuinfo=SKYLAKE)
    (record,) = caplog.records
    assert "training.mixed_precision_param" in record.getMessage()
    assert "'float32'" in record.getMessage()
