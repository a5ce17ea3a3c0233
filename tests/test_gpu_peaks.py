"""The peak MFU is divided by (training/loop/feed.py): found by the exact device name, memory
and SM count torch reports, scaled for a MIG slice, absent (and said once) for an unknown GPU."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from taehv_train.training.loop import feed

MIB = 2**20


@pytest.mark.parametrize(
    "name, memory_mib, sms, family, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 81559, 132, "H100 SXM", 989.5),
        ("NVIDIA H100 PCIe", 81559, 114, "H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", 95830, 132, "H100 NVL", 835.5),
        ("NVIDIA H200", 143771, 132, "H200", 989.5),
        ("NVIDIA H200 NVL", 143771, 132, "H200 NVL", 835.5),
        ("NVIDIA H800", 81559, 132, "H800 SXM", 989.5),
        ("NVIDIA H800 PCIe", 81559, 114, "H800 PCIe", 756.5),
        ("NVIDIA A100-SXM4-80GB", 81920, 108, "A100 SXM4 80GB", 312),
        ("NVIDIA A100-SXM4-40GB", 40960, 108, "A100 SXM4 40GB", 312),
        ("NVIDIA A100 80GB PCIe", 81920, 108, "A100 PCIe 80GB", 312),
        ("NVIDIA A800-SXM4-80GB", 81920, 108, "A800 SXM4 80GB", 312),
        ("NVIDIA L40S", 46068, 142, "L40S", 362.05),  # ECC on: 45 of its 48 GiB
        ("NVIDIA GeForce RTX 4090", 24564, 128, "RTX 4090", 165.2),
        ("NVIDIA GeForce RTX 3090", 24576, 82, "RTX 3090", 71),
        ("NVIDIA B200", 183359, 148, "B200", 2250),
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 40448, 60, "H100 SXM MIG slice (60 of 132 SMs)", 989.5 * 60 / 132),
    ],
)
def test_each_gpu_gets_its_own_datasheet_peak(name, memory_mib, sms, family, tflops):
    gpu = feed.identify_gpu(name, memory_mib * MIB, sms)
    assert gpu is not None and gpu.family == family
    assert gpu.bf16_flops == pytest.approx(tflops * 1e12)


def test_a_device_that_is_not_the_part_its_name_says_gets_no_peak():
    assert feed.identify_gpu("NVIDIA A100-SXM4-40GB", 81920 * MIB, 108) is None  # memory of an 80 GB part
    assert feed.identify_gpu("NVIDIA H100 PCIe", 81559 * MIB, 132) is None  # more SMs than the part has
    assert feed.identify_gpu("NVIDIA GeForce RTX 4090 D", 24564 * MIB, 114) is None  # not the RTX 4090


def test_an_unknown_gpu_gets_no_mfu_and_is_named_once(monkeypatch, caplog):
    k600 = SimpleNamespace(name="NVIDIA Quadro K600", total_memory=1023 * MIB, multi_processor_count=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: k600)
    feed._log_unknown_gpu.cache_clear()
    with caplog.at_level(logging.INFO, logger=feed.__name__):
        assert feed.local_gpu() is None
        assert feed.peak_flops(torch.device("cuda", 0), "bf16") is None
    (record,) = caplog.records
    assert "NVIDIA Quadro K600 (1.0 GiB, 1 SMs)" in record.getMessage()


def test_a_cpu_has_no_peak():
    assert feed.peak_flops(torch.device("cpu"), "bf16") is None
